// What the memory delivers to 1 and 2 threads reading 512 MB (3 passes, AVX-512 loads): the ceiling a
// memory-bound CPU decode step meets. Build and run:
//   gcc -O2 -mavx512f -pthread bench/cpu_bandwidth.c -o /tmp/cpu_bandwidth && /tmp/cpu_bandwidth
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BYTES (512L << 20)
#define PASSES 3

static char* buf;
static int threads;

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void* Read(void* arg) {
  const long id = (long)arg, per = BYTES / threads;
  __m512i acc = _mm512_setzero_si512();
  for (int pass = 0; pass < PASSES; ++pass)
    for (long i = id * per; i < (id + 1) * per; i += 64) acc = _mm512_add_epi32(acc, _mm512_load_si512(buf + i));
  return (void*)(long)_mm512_reduce_add_epi32(acc);   // keeps the loads
}

int main(void) {
  buf = aligned_alloc(64, BYTES);
  for (long i = 0; i < BYTES; ++i) buf[i] = (char)i;
  for (threads = 1; threads <= 2; ++threads) {
    pthread_t t[2];
    const double t0 = Now();
    for (long i = 0; i < threads; ++i) pthread_create(&t[i], 0, Read, (void*)i);
    for (int i = 0; i < threads; ++i) pthread_join(t[i], 0);
    printf("%d thread%s: %.1f GB/s\n", threads, threads > 1 ? "s" : "", (double)PASSES * BYTES / (Now() - t0) / 1e9);
  }
  free(buf);
  return 0;
}
