"""Compile caches: what a compiler would otherwise redo on every run, made once per worker
host on the host's toolchains and bound read-only into every sandbox at
:data:`SANDBOX_CACHE` (so no run can change what the next one uses).

| cache | what it holds | made by |
|---|---|---|
| ``cpp`` | precompiled ``<bits/stdc++.h>`` and ``<iostream>`` for ``g++ -std=c++17`` | ``g++ -x c++-header`` |
| ``java`` | a class-data-sharing archive of javac's classes (JDK 17's dynamic archive) | javac compiling a class once |
| ``go`` | a Go build cache after a build of a program importing common packages | ``go build`` (Debian's standard library comes precompiled in GOROOT/pkg) |
| ``typescript`` | V8 code caches of Debian's ``typescript.js``, one per heap size | Node running :data:`TS_RUNNER` |

Each is made the first time a run of its language needs it, in the background: the runs
before it is ready run without it (slower, the same result). A cache lives in a directory
named for the toolchain's files it was made from (their size and mtime), so an upgraded
toolchain gets a new one; it is made in a temporary directory and renamed into place, so a
sandbox never sees half of one and two workers on one host end with one copy. Rust needs
none: Debian ships its standard library compiled.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from temper.sandbox.languages import TYPESCRIPT_JS, heap_mb

log = logging.getLogger(__name__)

SANDBOX_CACHE = "/.temper-langs"  # where a bwrap sandbox sees the cache root (read-only)
BUILD_TIMEOUT_S = 300
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}

# Runs a TypeScript program as tsx does (types stripped, not checked; then the JavaScript
# in this process): ``node ts-run.js CACHE FILE.ts [args]``. CACHE is a V8 code cache of
# typescript.js for this heap size ("" or a missing file: compile it). ``--make-cache OUT``
# writes that cache instead.
TS_RUNNER = r"""'use strict';
const fs = require('fs'), vm = require('vm'), path = require('path'), Module = require('module');
const TS = '__TYPESCRIPT_JS__';
function loadTypeScript(cacheFile) {
  const wrapped = '(function (exports, require, module, __filename, __dirname) {' +
    fs.readFileSync(TS, 'utf8') + '\n})';
  let cachedData;
  if (cacheFile) { try { cachedData = fs.readFileSync(cacheFile); } catch (e) { cachedData = undefined; } }
  const script = new vm.Script(wrapped, { filename: TS, cachedData });
  const mod = { exports: {} };
  script.runInThisContext()(mod.exports, require, mod, TS, path.dirname(TS));
  return [mod.exports, script];
}
if (process.argv[2] === '--make-cache') {
  const [ts, script] = loadTypeScript(null);
  ts.transpileModule('const x: number = 1;', { compilerOptions: {} });
  fs.writeFileSync(process.argv[3], script.createCachedData());
  process.exit(0);
}
const [ts] = loadTypeScript(process.argv[2]);
const options = { module: ts.ModuleKind.CommonJS, target: ts.ScriptTarget.ES2020, esModuleInterop: true };
function transpile(file, source) {
  const out = ts.transpileModule(source, { compilerOptions: options, fileName: file, reportDiagnostics: true });
  if (out.diagnostics && out.diagnostics.length) {
    const host = { getCanonicalFileName: (f) => f, getCurrentDirectory: () => process.cwd(), getNewLine: () => '\n' };
    process.stderr.write(ts.formatDiagnostics(out.diagnostics, host));
    process.exit(1);
  }
  return out.outputText;
}
require.extensions['.ts'] = function (module, filename) {
  module._compile(transpile(filename, fs.readFileSync(filename, 'utf8')), filename);
};
const main = path.resolve(process.argv[3]);
process.argv.splice(1, 3, main);
Module._load(main, null, true);
"""


def _fingerprint(*paths: str) -> str:
    """A short name for the toolchain these files make up (their real paths, sizes and
    mtimes): another version of any of them, another cache directory."""
    digest = hashlib.sha256()
    for path in paths:
        real = os.path.realpath(path)
        st = os.stat(real)
        digest.update(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:12]


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
    subprocess.run(argv, cwd=cwd, env=env or ENV, check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)


def _first_header(header: str) -> str:
    """The file ``#include <header>`` finds for ``g++ -std=c++17``."""
    out = subprocess.run(
        ["/usr/bin/g++", "-std=c++17", "-H", "-fsyntax-only", "-x", "c++", "-"],
        input=f"#include <{header}>\n".encode(), env=ENV, capture_output=True, check=True, timeout=60,
    ).stderr.decode()  # fmt: skip
    for line in out.splitlines():
        if line.startswith(". "):
            return line[2:].strip()
    raise RuntimeError(f"g++ -H did not show where <{header}> is")


def build_cpp(out: Path) -> None:
    # A .gch next to nothing else on an -I directory: g++ looks for NAME.gch on each
    # directory before NAME itself, so the first #include of these headers finds it.
    for header in ("bits/stdc++.h", "iostream"):
        target = out / "include" / f"{header}.gch"
        target.parent.mkdir(parents=True, exist_ok=True)
        _run(
            ["/usr/bin/g++", "-std=c++17", "-x", "c++-header", _first_header(header), "-o", str(target)], out
        )


def build_java(out: Path) -> None:
    work = out / "work"
    work.mkdir()
    (work / "Main.java").write_text(
        "import java.util.*;\npublic class Main {\n  public static void main(String[] a) {\n"
        "    List<Integer> x = new ArrayList<>(List.of(3, 1, 2)); Collections.sort(x);\n"
        '    System.out.println(String.join(",", x.stream().map(String::valueOf).toList()));\n  }\n}\n'
    )
    # The same JVM options as the compile steps (temper.sandbox.languages.Java), which a
    # CDS archive must match.
    _run(["/usr/bin/javac", "-J-XX:ArchiveClassesAtExit=" + str(out / "javac.jsa"), "-J-XX:+UseSerialGC",
          "-J-XX:TieredStopAtLevel=1", "-J-XX:-UsePerfData", "-encoding", "UTF-8", "-d", "classes",
          "Main.java"], work)  # fmt: skip
    shutil.rmtree(work)


GO_WARMUP = """package main

import (
\t"bufio"
\t"container/heap"
\t"errors"
\t"fmt"
\t"math"
\t"os"
\t"sort"
\t"strconv"
\t"strings"
\t"unicode"
)

type h []int

func (x h) Len() int            { return len(x) }
func (x h) Less(i, j int) bool  { return x[i] < x[j] }
func (x h) Swap(i, j int)       { x[i], x[j] = x[j], x[i] }
func (x *h) Push(v interface{}) { *x = append(*x, v.(int)) }
func (x *h) Pop() interface{}   { o := *x; v := o[len(o)-1]; *x = o[:len(o)-1]; return v }

func main() {
\tw := bufio.NewWriter(os.Stdout)
\tdefer w.Flush()
\tq := &h{3, 1}
\theap.Init(q)
\ts := []string{"b", "a"}
\tsort.Strings(s)
\tfmt.Fprintln(w, strings.Join(s, ","), strconv.Itoa(heap.Pop(q).(int)), math.Sqrt(2), unicode.IsUpper('A'), errors.New("x"))
}
"""


def build_go(out: Path) -> None:
    work = out / "work"
    work.mkdir()
    (work / "main.go").write_text(GO_WARMUP)
    env = {**ENV, "GOCACHE": str(out / "gocache"), "GOPATH": str(work / "gopath"), "HOME": str(work),
           "GOPROXY": "off", "GOFLAGS": "-buildvcs=false", "GODEBUG": "goindex=0"}  # fmt: skip
    _run(["/usr/bin/go", "build", "-o", "main", "main.go"], work, env)
    shutil.rmtree(work)


class CompileCaches:
    """The caches of one worker host under ``root``, made on first need (``ready``)."""

    def __init__(self, root: Path, *, inner: str) -> None:
        self.root = root
        self.inner = inner  # where sandboxes see ``root``
        self.runner = root / "ts-run.js"
        self._fingerprints: dict[str, str | None] = {}
        self._building: set[str] = set()
        self.failed: dict[str, str] = {}  # cache -> why it could not be made (logged once)

    def prepare(self) -> None:
        """The root (reachable by the sandbox uid) and the TypeScript runner in it."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        text = TS_RUNNER.replace("__TYPESCRIPT_JS__", TYPESCRIPT_JS)
        if not self.runner.exists() or self.runner.read_text() != text:
            tmp = self.root / f".ts-run-{uuid.uuid4().hex[:8]}.js"
            tmp.write_text(text)
            tmp.chmod(0o644)
            tmp.replace(self.runner)

    @property
    def runner_inside(self) -> str:
        return f"{self.inner}/{self.runner.name}"

    def _name(self, cache: str) -> str | None:
        """``<cache>-<fingerprint>``, or None where the toolchain is not installed."""
        if cache not in self._fingerprints:
            try:
                self._fingerprints[cache] = f"{cache}-{_fingerprint(*SOURCES[cache])}"
            except OSError:
                self._fingerprints[cache] = None
        return self._fingerprints[cache]

    def ready(
        self, cache: str | None, spawn: Callable[[asyncio.Future[None]], object], *, memory_mb: int = 0
    ) -> str | None:
        """Where sandboxes see ``cache`` once it is made (for TypeScript: once the code
        cache of ``memory_mb``'s heap is made), else None. The first call for one that is
        not made starts making it in a thread; ``spawn`` takes the task, so that the
        manager's close waits for it."""
        if cache is None:
            return None
        name = self._name(cache)
        if name is None:
            return None
        unit = f"{name}/heap-{heap_mb(memory_mb)}.cache" if cache == "typescript" else name
        if (self.root / unit).exists():
            return f"{self.inner}/{name}"
        if unit not in self._building and unit not in self.failed:
            self._building.add(unit)
            task = asyncio.ensure_future(asyncio.to_thread(self._build, cache, unit))
            task.add_done_callback(lambda _t: self._building.discard(unit))
            spawn(task)
        return None

    def _build(self, cache: str, unit: str) -> None:
        """Make ``unit`` (a cache's directory, or a TypeScript heap's file in its own) in a
        temporary directory, then rename it into place."""
        final = self.root / unit
        final.parent.mkdir(parents=True, exist_ok=True)
        final.parent.chmod(0o755)
        tmp = Path(tempfile.mkdtemp(prefix=".making-", dir=self.root))
        try:
            if cache == "typescript":
                heap = int(unit.rsplit("heap-", 1)[1].split(".")[0])
                made = tmp / final.name
                _run(["/usr/bin/node", f"--max-old-space-size={heap}", str(self.runner), "--make-cache",
                      str(made)], tmp)  # fmt: skip
            else:
                made = tmp / "made"
                made.mkdir()
                BUILDERS[cache](made)
            for path in [made, *made.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            try:
                made.rename(final)
            except OSError:  # another worker on this host made it first
                if not final.exists():
                    raise
            log.info("compile cache %s made", final)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (
                exc.stderr.decode("utf-8", "replace")[-500:]
                if isinstance(exc, subprocess.CalledProcessError)
                else ""
            )
            self.failed[unit] = f"{exc} {detail}".strip()
            log.warning("compile cache %s not made (%s): runs go without it", unit, self.failed[unit])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# The toolchain files a cache is made from (its directory is named for their fingerprint).
SOURCES = {
    "cpp": ("/usr/bin/g++", "/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus"),
    "java": ("/usr/bin/javac", "/usr/lib/jvm/java-17-openjdk-amd64/lib/modules"),
    "go": ("/usr/bin/go", "/usr/lib/go-1.19/VERSION"),
    "typescript": ("/usr/bin/node", TYPESCRIPT_JS),
}
BUILDERS = {"cpp": build_cpp, "java": build_java, "go": build_go}
