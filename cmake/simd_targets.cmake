# FLASHATTN_SIMD_TARGETS: the SIMD targets the kernels' Highway compilation units
# (foreach_target) are built for.
#   all    every target Highway compiles by default, chosen at run time (CI and releases)
#   native only the one this machine dispatches to, besides Highway's static baseline:
#          each kernel file compiles two targets instead of all of them (development builds;
#          the binary runs on this machine's kind of CPU, slower on others)
# The tests that loop over the compiled targets then cover those two;
# CpuFeatures.ForEachSimdTargetVisitsTheDispatchedOne skips, naming the ones left out.
set(FLASHATTN_SIMD_TARGETS "all" CACHE STRING "SIMD targets of the kernels: all or native")
set_property(CACHE FLASHATTN_SIMD_TARGETS PROPERTY STRINGS all native)
if(FLASHATTN_SIMD_TARGETS STREQUAL "native")
  try_run(FLASHATTN_SIMD_PROBE_RAN FLASHATTN_SIMD_PROBE_BUILT
    ${PROJECT_BINARY_DIR}/simd_targets_probe ${PROJECT_SOURCE_DIR}/cmake/simd_targets_probe.cpp
    LINK_LIBRARIES hwy::hwy
    COMPILE_OUTPUT_VARIABLE probe_build
    RUN_OUTPUT_VARIABLE probe)
  if(NOT FLASHATTN_SIMD_PROBE_BUILT OR NOT FLASHATTN_SIMD_PROBE_RAN EQUAL 0)
    message(FATAL_ERROR "FLASHATTN_SIMD_TARGETS=native: cannot run the target probe\n${probe_build}")
  endif()
  string(REPLACE "\n" ";" probe "${probe}")
  list(GET probe 0 left_out_mask)
  list(GET probe 1 left_out_names)
  message(STATUS "FLASHATTN_SIMD_TARGETS=native: leaving out SIMD targets ${left_out_names}")
  # The kernels' layer, and public within the build tree: the tests must loop over the
  # targets the library has.
  target_compile_definitions(flashattn_cpu PUBLIC
    $<BUILD_INTERFACE:HWY_DISABLED_TARGETS=${left_out_mask}>
    "$<BUILD_INTERFACE:FLASHATTN_SIMD_TARGETS_LEFT_OUT=\"${left_out_names}\">")
  target_compile_definitions(flashattn PUBLIC
    $<BUILD_INTERFACE:HWY_DISABLED_TARGETS=${left_out_mask}>
    "$<BUILD_INTERFACE:FLASHATTN_SIMD_TARGETS_LEFT_OUT=\"${left_out_names}\">")
elseif(NOT FLASHATTN_SIMD_TARGETS STREQUAL "all")
  message(FATAL_ERROR "FLASHATTN_SIMD_TARGETS must be all or native, got ${FLASHATTN_SIMD_TARGETS}")
endif()
