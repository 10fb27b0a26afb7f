// Temper's test runner for Go (temper.rewards.polyglot): the test program's main.go, beside
// the code under test in solution.go (package main). temperStart reads "NONCE PER_TEST_S
// MAX_TIMEOUTS" from stdin, points os.Stdout and os.Stderr at /dev/null, and each test is
// reported on the original stdout as one line "NONCE {json}" (the Python harness's
// events). Tests assert with assert(cond, message...) and assertEqual(got, want) (reflect's
// DeepEqual); a failing one, or any panic, ends its test and the next test runs.
package main

import (
	temperbufio "bufio"
	temperfmt "fmt"
	temperos "os"
	temperreflect "reflect"
	temperstrings "strings"
	tempertime "time"
)

//@IMPORTS@

type temperAssertion struct{ message string }

var (
	temperOut   *temperos.File
	temperNonce string
	temperTotal float64
)

func assert(cond bool, message ...interface{}) {
	if !cond {
		text := "assertion failed"
		if len(message) > 0 {
			text += ": " + temperfmt.Sprint(message...)
		}
		panic(temperAssertion{text})
	}
}

func assertEqual(got, want interface{}) {
	if !temperreflect.DeepEqual(got, want) {
		panic(temperAssertion{temperfmt.Sprintf("assertion failed: got %#v, want %#v", got, want)})
	}
}

func temperEvent(body string) {
	temperfmt.Fprintf(temperOut, "%s {%s}\n", temperNonce, body)
}

func temperJSON(s string) string {
	var b temperstrings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r < 0x20:
			temperfmt.Fprintf(&b, "\\u%04x", r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

func temperStart() {
	line, _ := temperbufio.NewReader(temperos.Stdin).ReadString('\n')
	if fields := temperstrings.Fields(line); len(fields) > 0 {
		temperNonce = fields[0]
	}
	temperOut = temperos.Stdout
	if null, err := temperos.OpenFile(temperos.DevNull, temperos.O_WRONLY, 0); err == nil {
		temperos.Stdout = null
		temperos.Stderr = null
	}
	temperfmt.Fprint(temperOut, "\n")
	temperEvent(`"ev": "candidate", "label": "run", "compile": null, "load": null`)
}

func temperTest(index int, test func()) {
	t0 := tempertime.Now()
	message := ""
	failed := false
	func() {
		defer func() {
			if r := recover(); r != nil {
				failed = true
				if a, ok := r.(temperAssertion); ok {
					message = a.message
				} else {
					message = "panic: " + temperfmt.Sprint(r)
				}
			}
		}()
		test()
	}()
	s := tempertime.Since(t0).Seconds()
	temperTotal += s
	msg := "null"
	if failed {
		if len(message) > 500 {
			message = message[:500]
		}
		msg = temperJSON(message)
	}
	temperEvent(temperfmt.Sprintf(`"ev": "test", "label": "run", "i": %d, "ok": %t, "msg": %s, "s": %.7f`, index, !failed, msg, s))
}

func temperFinish() {
	temperEvent(temperfmt.Sprintf(`"ev": "timing", "label": "run", "best_s": %.7f`, temperTotal))
	temperEvent(`"ev": "end"`)
}
