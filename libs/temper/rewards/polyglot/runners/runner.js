// Temper's test runner for JavaScript and TypeScript (temper.rewards.polyglot): written after
// the code under test; the tests run inside __temperMain below it. The runner reads
// "NONCE PER_TEST_S MAX_TIMEOUTS" from stdin, silences process.stdout and process.stderr (so
// console.log too), and reports each test on file descriptor 1 as one line "NONCE {json}" (the
// Python harness's events). Anything a test throws (node:assert's AssertionError included)
// ends that test; the next test runs.
const __temper = (function () {
  const fs = require('fs');
  const nonce = (fs.readFileSync(0, 'utf8').trim().split(/\s+/)[0]) || '';
  let total = 0;
  let t0 = 0n;
  const quiet = function () { return true; };
  process.stdout.write = quiet;
  process.stderr.write = quiet;
  function event(body) {
    const line = Buffer.from(nonce + ' {' + body + '}\n', 'utf8');
    let done = 0;
    while (done < line.length) done += fs.writeSync(1, line, done);
  }
  function message(e) {
    if (e instanceof Error) {
      const name = e.name === 'AssertionError' ? 'assertion failed' : e.name;
      return e.message ? name + ': ' + e.message : name;
    }
    return 'threw ' + String(e);
  }
  fs.writeSync(1, '\n');
  event('"ev": "candidate", "label": "run", "compile": null, "load": null');
  return {
    test(index, body) {
      t0 = process.hrtime.bigint();
      let failure = null;
      try {
        body();
      } catch (e) {
        failure = message(e).slice(0, 500);
      }
      const s = Number(process.hrtime.bigint() - t0) / 1e9;
      total += s;
      event('"ev": "test", "label": "run", "i": ' + index + ', "ok": ' + (failure === null) + ', "msg": ' +
            (failure === null ? 'null' : JSON.stringify(failure)) + ', "s": ' + s.toFixed(7));
    },
    finish() {
      event('"ev": "timing", "label": "run", "best_s": ' + total.toFixed(7));
      event('"ev": "end"');
    },
  };
})();
