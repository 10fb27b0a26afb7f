// Temper's test runner for Rust (temper.rewards.polyglot): written after the code under
// test, before the tests' own main. start() reads "NONCE PER_TEST_S MAX_TIMEOUTS" from
// stdin, sends the code's stdout and stderr to /dev/null, and each test is reported on the
// original stdout as one line "NONCE {json}" (the Python harness's events). A panic (a
// failing assert!, assert_eq! or assert_ne!, an overflow, an index out of range) ends its
// test; the next test runs. Edition 2015, as the program is compiled.
#[allow(dead_code)]
mod temper_runner {
    use std::cell::RefCell;
    use std::fs::File;
    use std::io::Write;
    use std::os::unix::io::{AsRawFd, FromRawFd};
    use std::time::Instant;

    extern "C" {
        fn dup(fd: i32) -> i32;
        fn dup2(from: i32, to: i32) -> i32;
    }

    thread_local! {
        static MESSAGE: RefCell<String> = RefCell::new(String::new());
    }

    pub struct Runner {
        out: File,
        nonce: String,
        total: f64,
    }

    fn json(s: &str) -> String {
        let mut b = String::from("\"");
        for c in s.chars() {
            match c {
                '"' | '\\' => {
                    b.push('\\');
                    b.push(c);
                }
                c if (c as u32) < 0x20 => b.push_str(&format!("\\u{:04x}", c as u32)),
                c => b.push(c),
            }
        }
        b.push('"');
        b
    }

    impl Runner {
        fn event(&mut self, body: &str) {
            let line = format!("{} {{{}}}\n", self.nonce, body);
            let _ = self.out.write_all(line.as_bytes());
            let _ = self.out.flush();
        }

        pub fn test<F: FnOnce()>(&mut self, index: usize, f: F) {
            MESSAGE.with(|m| m.borrow_mut().clear());
            let t0 = Instant::now();
            let result = ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(f));
            let elapsed = t0.elapsed();
            let s = elapsed.as_secs() as f64 + elapsed.subsec_nanos() as f64 / 1e9;
            self.total += s;
            let msg = match result {
                Ok(_) => "null".to_string(),
                Err(_) => {
                    let mut m = MESSAGE.with(|m| m.borrow().clone());
                    if m.is_empty() {
                        m = "panicked".to_string();
                    }
                    let cut: String = m.chars().take(500).collect();
                    json(&cut)
                }
            };
            let ok = msg == "null";
            self.event(&format!(
                "\"ev\": \"test\", \"label\": \"run\", \"i\": {}, \"ok\": {}, \"msg\": {}, \"s\": {:.7}",
                index, ok, msg, s
            ));
        }

        pub fn finish(&mut self) {
            let body = format!("\"ev\": \"timing\", \"label\": \"run\", \"best_s\": {:.7}", self.total);
            self.event(&body);
            self.event("\"ev\": \"end\"");
        }
    }

    pub fn start() -> Runner {
        let mut line = String::new();
        let _ = ::std::io::stdin().read_line(&mut line);
        let nonce = line.split_whitespace().next().unwrap_or("").to_string();
        let _ = ::std::io::stdout().flush();
        let out = unsafe { File::from_raw_fd(dup(1)) };
        if let Ok(null) = ::std::fs::OpenOptions::new().write(true).open("/dev/null") {
            unsafe {
                dup2(null.as_raw_fd(), 1);
                dup2(null.as_raw_fd(), 2);
            }
        }
        ::std::panic::set_hook(Box::new(|info: &::std::panic::PanicInfo| {
            let payload = info.payload();
            let text = if let Some(s) = payload.downcast_ref::<&str>() {
                s.to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "panicked".to_string()
            };
            MESSAGE.with(|m| *m.borrow_mut() = text);
        }));
        let mut runner = Runner { out: out, nonce: nonce, total: 0.0 };
        let _ = runner.out.write_all(b"\n");
        runner.event("\"ev\": \"candidate\", \"label\": \"run\", \"compile\": null, \"load\": null");
        runner
    }
}
