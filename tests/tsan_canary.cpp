// Evidence that ThreadSanitizer sees races inside OpenMP regions in this build: `race`
// increments a shared counter from every thread without synchronization and must be
// reported; `clean` does the same through an OpenMP reduction and must not be. scripts/test
// runs both before trusting TSan's silence on the library (libomp's Archer tool supplies the
// runtime's synchronization to TSan).
#include <omp.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  const bool race = argc > 1 && std::strcmp(argv[1], "race") == 0;
  long counter = 0;
  if (race) {
#pragma omp parallel num_threads(4)
    for (int i = 0; i < 1000; ++i) counter = counter + 1;
  } else {
#pragma omp parallel for num_threads(4) reduction(+ : counter)
    for (int i = 0; i < 4000; ++i) counter = counter + 1;
  }
  std::printf("%ld\n", counter);
  return 0;
}
