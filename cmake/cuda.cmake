# The CUDA backend (src/cuda): optional, on when nvcc is found; the CPU build never needs it.
# The .cu files are compiled by custom commands rather than CMake's CUDA language so that
# every compile also leaves its `ptxas -v` report beside its object: the gates of
# tests/cuda_gates.py read those reports and disassemble those objects, nothing is compiled
# twice. Targets: sm_80 (mma.sync, cp.async, ldmatrix) and sm_90 as SASS, compute_90 as PTX
# for later GPUs.
option(FLASHATTN_CUDA "Build the CUDA kernels (needs nvcc; sm_80 and sm_90)" ON)
if(SKBUILD)
  set(FLASHATTN_CUDA OFF)  # a wheel carries the CPU backend only
endif()

set(FLASHATTN_CUDA_BUILT OFF)
if(FLASHATTN_CUDA)
  find_program(FLASHATTN_NVCC nvcc HINTS $ENV{CUDACXX} ENV CUDA_PATH PATHS /usr/local/cuda/bin)
  if(FLASHATTN_NVCC)
    get_filename_component(_nvcc_bin "${FLASHATTN_NVCC}" DIRECTORY)
    get_filename_component(CUDAToolkit_ROOT "${_nvcc_bin}" DIRECTORY)
    find_package(CUDAToolkit)
  endif()
  if(FLASHATTN_NVCC AND CUDAToolkit_FOUND)
    set(FLASHATTN_CUDA_BUILT ON)
  else()
    message(STATUS "nvcc not found: the CUDA backend is not built (calls on cuda tensors throw)")
  endif()
endif()

if(FLASHATTN_CUDA_BUILT)
  set(FLASHATTN_CUDA_TARGETS
      -gencode=arch=compute_80,code=sm_80
      -gencode=arch=compute_90,code=sm_90
      -gencode=arch=compute_90,code=compute_90)
  set(FLASHATTN_CUDA_OBJECTS)
  set(FLASHATTN_CUDA_PTXAS_LOGS)
  foreach(source forward backward)
    set(obj ${PROJECT_BINARY_DIR}/cuda/${source}.o)
    set(log ${PROJECT_BINARY_DIR}/cuda/${source}.ptxas.log)
    add_custom_command(
      OUTPUT ${obj} ${log}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${PROJECT_BINARY_DIR}/cuda
      COMMAND ${PROJECT_SOURCE_DIR}/cmake/nvcc_with_report.sh ${log}
              ${FLASHATTN_NVCC} -std=c++20 -O3 -DNDEBUG -Xcompiler=-fPIC
              -I${PROJECT_SOURCE_DIR} -I${PROJECT_SOURCE_DIR}/include ${FLASHATTN_CUDA_TARGETS}
              -Xptxas=-v -MD -MF ${obj}.d -c ${PROJECT_SOURCE_DIR}/src/cuda/${source}.cu -o ${obj}
      DEPFILE ${obj}.d
      DEPENDS ${PROJECT_SOURCE_DIR}/src/cuda/${source}.cu
      COMMENT "nvcc src/cuda/${source}.cu (sm_80, sm_90, compute_90)"
      VERBATIM)
    list(APPEND FLASHATTN_CUDA_OBJECTS ${obj})
    list(APPEND FLASHATTN_CUDA_PTXAS_LOGS ${log})
  endforeach()
  target_sources(flashattn_cuda PRIVATE src/cuda/runtime.cpp)
  target_sources(flashattn PRIVATE ${FLASHATTN_CUDA_OBJECTS})
  set_source_files_properties(${FLASHATTN_CUDA_OBJECTS} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
  target_link_libraries(flashattn_cuda PRIVATE CUDA::cudart_static)  # runtime.cpp: the headers
  target_link_libraries(flashattn PRIVATE CUDA::cudart_static)
else()
  target_sources(flashattn_cuda PRIVATE src/cuda/unavailable.cpp)
endif()
