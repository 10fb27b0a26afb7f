/* Temper's test runner for C and C++ (temper.rewards.polyglot): written after the code
 * under test, before the tests' own main. It reads "NONCE PER_TEST_S MAX_TIMEOUTS" from
 * stdin, sends the code's stdout and stderr to /dev/null, and reports each test on the
 * original stdout as one line "NONCE {json}" (the Python harness's events).
 *
 * assert() is redefined after it (and after the tests' own #includes): a failing one ends its test (longjmp in C, an exception in C++)
 * and the next test runs. A signal (a crash, abort(), the per-test timer) ends its test the
 * same way. */
#undef main
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#ifdef __cplusplus
#include <exception>
#endif

static int temper_out = 1;
static char temper_nonce[80];
static double temper_per_test_s = 3.0;
static int temper_max_timeouts = 2;
static int temper_timeouts;
static int temper_failed;
static char temper_message[512];
static double temper_total;
static struct timespec temper_t0;
static sigjmp_buf temper_jump;
static volatile sig_atomic_t temper_in_test;
static int temper_ran;

#ifdef __cplusplus
struct temper_failure {};
#endif

static void temper_write(const char *s, size_t n) {
    while (n > 0) {
        ssize_t w = write(temper_out, s, n);
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

/* "NONCE {" + body + "}\n", the body's strings already escaped */
static void temper_event(const char *body) {
    char line[2048];
    int n = snprintf(line, sizeof line, "%s {%s}\n", temper_nonce, body);
    if (n > (int)sizeof line - 1) n = (int)sizeof line - 1;
    temper_write(line, (size_t)n);
}

static void temper_json(char *out, size_t cap, const char *s) {
    size_t j = 0;
    out[j++] = '"';
    for (; *s && j + 8 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[j++] = '\\';
            out[j++] = (char)c;
        } else if (c < 0x20) {
            j += (size_t)snprintf(out + j, cap - j, "\\u%04x", c);
        } else {
            out[j++] = (char)c;
        }
    }
    out[j++] = '"';
    out[j] = 0;
}

static void temper_fail(const char *message) {
    if (!temper_failed) {
        temper_failed = 1;
        snprintf(temper_message, sizeof temper_message, "%s", message);
    }
}

static void temper_assert_failed(const char *expression) {
    char message[512];
    snprintf(message, sizeof message, "assertion failed: %.480s", expression);
    temper_fail(message);
#ifdef __cplusplus
    throw temper_failure();
#else
    siglongjmp(temper_jump, 1);
#endif
}

#ifdef __cplusplus
static void temper_fail_what(const char *what) {
    char message[512];
    snprintf(message, sizeof message, "exception: %.480s", what);
    temper_fail(message);
}
#endif

static void temper_on_signal(int sig) {
    if (!temper_in_test) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    if (sig == SIGALRM) {
        char message[96];
        snprintf(message, sizeof message, "timeout: the test ran past %.1fs", temper_per_test_s);
        temper_fail(message);
        temper_timeouts++;
    } else {
        char message[96];
        snprintf(message, sizeof message, "killed by signal %d (%s)", sig, strsignal(sig));
        temper_fail(message);
    }
    siglongjmp(temper_jump, 1);
}

static void temper_timer(double seconds) {
    struct itimerval t;
    memset(&t, 0, sizeof t);
    t.it_value.tv_sec = (time_t)seconds;
    t.it_value.tv_usec = (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6);
    setitimer(ITIMER_REAL, &t, NULL);
}

static void temper_start(void) {
    char line[160] = {0};
    if (fgets(line, sizeof line, stdin) != NULL) {
        sscanf(line, "%79s %lf %d", temper_nonce, &temper_per_test_s, &temper_max_timeouts);
    }
    fflush(stdout);
    fflush(stderr);
    temper_out = dup(1);
    int null_fd = open("/dev/null", O_WRONLY);
    if (null_fd >= 0) {
        dup2(null_fd, 1);
        dup2(null_fd, 2);
        close(null_fd);
    }
    int signals[] = {SIGSEGV, SIGFPE, SIGBUS, SIGABRT, SIGILL, SIGALRM};
    for (size_t k = 0; k < sizeof signals / sizeof signals[0]; k++) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = temper_on_signal;
        sa.sa_flags = SA_NODEFER;
        sigaction(signals[k], &sa, NULL);
    }
    temper_write("\n", 1);
    temper_event("\"ev\": \"candidate\", \"label\": \"run\", \"compile\": null, \"load\": null");
}

/* Before a test: 1 when it should run, 0 when earlier timeouts stopped the run of tests. */
static int temper_begin(void) {
    temper_failed = 0;
    temper_message[0] = 0;
    temper_ran = 0;
    if (temper_timeouts >= temper_max_timeouts) {
        temper_fail("not run: earlier tests timed out");
        return 0;
    }
    clock_gettime(CLOCK_MONOTONIC, &temper_t0);
    temper_ran = 1;
    temper_in_test = 1;
    temper_timer(temper_per_test_s);
    return 1;
}

static void temper_end(int index) {
    struct timespec t1;
    temper_timer(0);
    temper_in_test = 0;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - temper_t0.tv_sec) + (double)(t1.tv_nsec - temper_t0.tv_nsec) / 1e9;
    if (!temper_ran) s = 0;
    temper_total += s;
    char message[1100], body[1400];
    if (temper_failed) {
        temper_json(message, sizeof message, temper_message);
    } else {
        snprintf(message, sizeof message, "null");
    }
    snprintf(body, sizeof body, "\"ev\": \"test\", \"label\": \"run\", \"i\": %d, \"ok\": %s, \"msg\": %s, \"s\": %.7f",
             index, temper_failed ? "false" : "true", message, s);
    temper_event(body);
}

static void temper_finish(void) {
    char body[160];
    snprintf(body, sizeof body, "\"ev\": \"timing\", \"label\": \"run\", \"best_s\": %.7f", temper_total);
    temper_event(body);
    temper_event("\"ev\": \"end\"");
}
