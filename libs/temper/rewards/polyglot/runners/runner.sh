# Temper's test runner for bash (temper.rewards.polyglot): it starts the test program, before
# the code under test. __temper_start reads "NONCE PER_TEST_S MAX_TIMEOUTS" from stdin, keeps
# the original stdout on descriptor 3 and sends the program's own output to /dev/null; each
# test runs in a subshell (an exit or a failing command ends only that test) and is reported
# on descriptor 3 as one line "NONCE {json}" (the Python harness's events). Safe under set -e.
__temper_total=0
__temper_start() {
    read -r __temper_nonce __temper_rest || true
    exec 3>&1 1>/dev/null 2>&1
    printf '\n%s {"ev": "candidate", "label": "run", "compile": null, "load": null}\n' "$__temper_nonce" >&3
}
__temper_now() {
    local now=${EPOCHREALTIME/[.,]/}
    printf '%s' "$((10#$now))"
}
__temper_end() {  # index, exit status of the test, its start in microseconds
    local us=$(( $(__temper_now) - $3 ))
    __temper_total=$(( __temper_total + us ))
    local s
    s=$(printf '%d.%06d' $(( us / 1000000 )) $(( us % 1000000 )))
    if [ "$2" = 0 ]; then
        printf '%s {"ev": "test", "label": "run", "i": %d, "ok": true, "msg": null, "s": %s}\n' \
            "$__temper_nonce" "$1" "$s" >&3
    else
        printf '%s {"ev": "test", "label": "run", "i": %d, "ok": false, "msg": "test failed (exit status %d)", "s": %s}\n' \
            "$__temper_nonce" "$1" "$2" "$s" >&3
    fi
}
__temper_finish() {
    printf '%s {"ev": "timing", "label": "run", "best_s": %d.%06d}\n%s {"ev": "end"}\n' "$__temper_nonce" \
        $(( __temper_total / 1000000 )) $(( __temper_total % 1000000 )) "$__temper_nonce" >&3
}
__temper_start
