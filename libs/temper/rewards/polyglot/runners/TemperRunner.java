// Temper's test runner for Java (temper.rewards.polyglot): a class of its own in the test
// program's Main.java. start() reads "NONCE PER_TEST_S MAX_TIMEOUTS" from stdin, sends the
// code's System.out and System.err to nowhere, and each test is reported on the original
// stdout as one line "NONCE {json}" (the Python harness's events). A failing assert (the
// JVM runs with -ea) or any Throwable ends its test; the next test runs.
final class TemperRunner {
    private static java.io.PrintStream out;
    private static String nonce = "";
    private static boolean failed;
    private static String message;
    private static long t0;
    private static double total;

    private TemperRunner() {}

    static void start() throws java.io.IOException {
        java.io.BufferedReader in = new java.io.BufferedReader(new java.io.InputStreamReader(System.in));
        String line = in.readLine();
        if (line != null) {
            nonce = line.trim().split("\\s+")[0];
        }
        out = new java.io.PrintStream(new java.io.FileOutputStream(java.io.FileDescriptor.out), false, "UTF-8");
        java.io.PrintStream nowhere = new java.io.PrintStream(java.io.OutputStream.nullOutputStream());
        System.setOut(nowhere);
        System.setErr(nowhere);
        out.print("\n");
        event("\"ev\": \"candidate\", \"label\": \"run\", \"compile\": null, \"load\": null");
    }

    static void begin() {
        failed = false;
        message = null;
        t0 = System.nanoTime();
    }

    static void fail(Throwable e) {
        failed = true;
        if (e instanceof AssertionError) {
            message = e.getMessage() == null ? "assertion failed" : "assertion failed: " + e.getMessage();
        } else {
            message = e.toString();
        }
    }

    static void end(int index) {
        double s = (System.nanoTime() - t0) / 1e9;
        total += s;
        String msg = failed ? json(message.length() > 500 ? message.substring(0, 500) : message) : "null";
        event("\"ev\": \"test\", \"label\": \"run\", \"i\": " + index + ", \"ok\": " + !failed + ", \"msg\": " + msg
                + ", \"s\": " + String.format(java.util.Locale.ROOT, "%.7f", s));
    }

    static void finish() {
        event("\"ev\": \"timing\", \"label\": \"run\", \"best_s\": " + String.format(java.util.Locale.ROOT, "%.7f", total));
        event("\"ev\": \"end\"");
        out.flush();
    }

    private static void event(String body) {
        out.print(nonce + " {" + body + "}\n");
        out.flush();
    }

    private static String json(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (c == '"' || c == '\\') {
                b.append('\\').append(c);
            } else if (c < 0x20) {
                b.append(String.format("\\u%04x", (int) c));
            } else {
                b.append(c);
            }
        }
        return b.append('"').toString();
    }
}
