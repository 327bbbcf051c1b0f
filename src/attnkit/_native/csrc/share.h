// Work shared by the calling thread and other threads (share).
//
// A parallel region (at::parallel_for, OpenMP underneath) ends when every thread it woke has
// passed its end, including threads that found nothing left to do. On a machine whose other
// cores are busy, a woken thread may wait a time slice of the scheduler (milliseconds) before it
// runs at all, and a small call (a decode step against a short cache, a fraction of a
// millisecond) then takes several times as long with two threads as with one. On a quiet machine
// the region is the fastest way to share a call: its threads spin a while after each region, so
// the next one starts at once, where waking a sleeping thread takes a tenth of a millisecond.
//
// So a call opens a region and times how long its calling thread waited at the end; after a
// wait that long (a thread came late), calls for the next second share their work with helpers
// from torch's inter-op pool instead: the calling thread starts on the work at once, helpers join
// when they get a core, and the caller waits only for helpers that joined before it ran out of
// work; one that starts later finds the work closed and returns without touching it.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

namespace attnkit {
// Internal linkage, as in one translation unit (see common.h).
namespace {

// Set in a child process made by fork(): the inter-op pool it inherited has no threads (and a
// lock one of them held at the fork stays held), and an OpenMP region there can wait forever for
// the parent's threads, so calls there run on the calling thread alone.
inline std::atomic<bool>& forked() {
  static std::atomic<bool> flag{false};
  static const int registered = pthread_atfork(nullptr, nullptr, [] { forked().store(true); });
  (void)registered;
  return flag;
}
// Each source file has its own flag (internal linkage): each registers it when the library loads,
// so a fork after any call at all (or none) sets it, whichever file's code the parent ran.
[[maybe_unused]] const bool kForkWatched = (forked(), true);

// at::parallel_for, or f(begin, end) on the calling thread in a child made by fork() (see
// forked), as within a parallel region.
template <typename F>
void parallel(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (forked().load()) {
    if (begin < end) f(begin, end);
    return;
  }
  at::parallel_for(begin, end, grain, f);
}

// A region's calling thread that waited at its end for longer than this (and a quarter of the
// region's time) saw a thread come late: calls share work with helpers for kBusyForNs after.
constexpr int64_t kLateNs = 200 * 1000;
constexpr int64_t kBusyForNs = 1000 * 1000 * 1000;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// $ATTNKIT_SHARE: "region" or "helpers" fixes how calls share their work (a server that knows
// its machine is shared, a test); unset, "timed" or anything else, the timing decides.
enum class Sharing { timed, region, helpers };
inline Sharing sharing() {
  static const Sharing chosen = [] {
    const char* text = std::getenv("ATTNKIT_SHARE");
    std::string name = text == nullptr ? "" : text;
    // As attnkit reads it (which warns of a misspelling): any case, spaces around.
    name.erase(0, name.find_first_not_of(" \t\r\n"));
    name.erase(name.find_last_not_of(" \t\r\n") + 1);
    for (char& ch : name) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    return name == "region" ? Sharing::region : name == "helpers" ? Sharing::helpers : Sharing::timed;
  }();
  return chosen;
}

// Until when (now_ns) calls share work with helpers rather than open a parallel region.
inline std::atomic<int64_t>& busy_until() {
  static std::atomic<int64_t> until{0};
  return until;
}

// body() on `threads` threads of a parallel region, timed (see the top of this file).
template <typename F>
void run_region(int64_t threads, F& body) {
  const int64_t start = now_ns();
  std::atomic<int64_t> done{0};  // when the calling thread ran out of work
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    body();
    if (at::get_thread_num() == 0) done.store(now_ns());
  });
  const int64_t end = now_ns(), waited = end - done.load();
  if (done.load() > 0 && waited > kLateNs && 4 * waited > end - start) {
    busy_until().store(end + kBusyForNs, std::memory_order_relaxed);
  }
}

// Runs body() on the calling thread and on up to `helpers` more: a parallel region's, or, for a
// second after a region's thread came late, threads of torch's inter-op pool (see the top of this
// file). Each run of body must claim its work (see claim) and return when none is left; the runs
// share only what body's claims hand out. An exception from any run is rethrown here, after every
// run that started has returned. Inside a parallel region, in a child made by fork(), or with no
// helpers asked for, body runs on the calling thread alone.
template <typename F>
void share(int64_t helpers, F& body) {
  if (helpers <= 0 || at::in_parallel_region() || forked().load()) {
    body();
    return;
  }
  const Sharing how = sharing();
  if (how == Sharing::region ||
      (how == Sharing::timed && now_ns() >= busy_until().load(std::memory_order_relaxed))) {
    run_region(helpers + 1, body);
    return;
  }
  // The helpers hold the state (not the caller's stack) until they return: a helper that starts
  // after the call has returned reads only `open` and `inside` here.
  struct State {
    std::atomic<bool> open{true};
    std::atomic<int> inside{0};  // helpers between their check of `open` and their return
    std::mutex m;
    std::condition_variable left;
    std::exception_ptr error;
    F* body = nullptr;
  };
  auto s = std::make_shared<State>();
  s->body = &body;
  auto helper = [s] {
    // Sequentially consistent, as the caller's close below: either the caller sees this helper
    // inside and waits for it, or the helper sees the work closed.
    s->inside.fetch_add(1);
    if (s->open.load()) {
      try {
        (*s->body)();
      } catch (...) {
        std::lock_guard<std::mutex> g(s->m);
        if (!s->error) s->error = std::current_exception();
      }
    }
    if (s->inside.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> g(s->m);
      s->left.notify_all();
    }
  };
  try {
    for (int64_t i = 0; i < helpers; ++i) at::launch(helper);
  } catch (...) {
    // A helper the pool could not take is one helper fewer: the caller does its share.
  }
  std::exception_ptr mine;
  try {
    body();
  } catch (...) {
    mine = std::current_exception();
  }
  s->open.store(false);
  {
    std::unique_lock<std::mutex> g(s->m);
    s->left.wait(g, [&] { return s->inside.load() == 0; });
  }
  if (mine) std::rethrow_exception(mine);
  if (s->error) std::rethrow_exception(s->error);
}

}  // namespace
}  // namespace attnkit
