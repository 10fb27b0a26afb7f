"""The languages a program may be written in: SandboxFusion's names for them (plus
``c``), the Debian package each toolchain comes from, how a program is compiled (where its
language has a compile step) and run, and the flags that size a runtime's heap from the
run's memory limit. ``temper.sandbox.programs`` runs them; ``temper.sandbox.compile_cache``
holds what their compilers need not redo on every run.

Every command names its tool by an absolute path under ``/usr`` and runs with
``PATH=/usr/bin:/bin``: a sandbox on the host binds the host's ``/usr``, and what a host
keeps in ``/usr/local`` (or root's home) is never what a run gets. A task image brings its
own ``/usr`` and so its own toolchains, at the same paths.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from temper.limits import LanguageName

BUILD_ARCHIVE = ".temper-build.tar"  # what a compile step leaves for its run (a tar of its outputs)
PATH = "/usr/bin:/bin"
JAVA_CLASSPATH = ("/usr/share/java/javatuples.jar",)  # MultiPL-E's Java uses org.javatuples
TYPESCRIPT_JS = "/usr/share/nodejs/typescript/lib/typescript.js"  # Debian's node-typescript
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
# A heap is a whole step of these (MB): a TypeScript run's code cache is made per heap size
# (V8 refuses a cache made under other flags), so runs share a few sizes, not one each.
HEAP_STEPS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144)


def heap_mb(memory_mb: int) -> int:
    """The heap a JVM (``-Xmx``) or Node (``--max-old-space-size``) gets in a step of
    ``memory_mb``: the limit less a quarter of it (at least 64 MB) for the runtime's own
    memory beside its heap (code, metadata, threads, buffers), rounded down to a step of
    :data:`HEAP_STEPS`. So a program that asks for too much meets its language's
    out-of-memory error, not the cgroup's kill."""
    room = memory_mb - max(64, memory_mb // 4)
    fitting = [step for step in HEAP_STEPS if step <= room]
    if fitting:
        return fitting[-1]
    return HEAP_STEPS[0] if room < HEAP_STEPS[-1] else (room // 1024) * 1024


@dataclass(frozen=True)
class Step:
    """What a language's command may depend on: the step's memory limit, where its compile
    cache is inside the sandbox (None: not ready, the step runs without it), and the program's
    other source files."""

    memory_mb: int
    cache: str | None = None
    sources: tuple[str, ...] = ()  # other source files compiled with the language's own (Go's)


class Language:
    """One language: the file its code is written to, its toolchain, and its commands (argv
    lists, run in the workspace). A language with a compile step compiles in a run of its
    own and leaves its outputs in :data:`BUILD_ARCHIVE` for the program's run."""

    name: LanguageName
    source: str  # the code's file in the workspace
    package: str  # the Debian package(s) of its toolchain (scripts/setup_system.sh langs)
    version: tuple[str, ...]  # prints the toolchain's version
    in_process: bool = False  # Python: the sandbox's agent runs the code itself, no interpreter start
    # An address-space limit becomes the language's own out-of-memory error (Python's
    # MemoryError) rather than a crash: run_program can set it (SandboxFusion's way).
    address_space_error: bool = False
    cache: str | None = None  # the compile cache it uses (temper.sandbox.compile_cache), if any

    @property
    def tools(self) -> tuple[str, ...]:
        """The files its commands need (on the host's /usr, or a task image's)."""
        return (self.version[0],)

    def missing(self, root: str = "/") -> list[str]:
        """Which of :attr:`tools` are not under ``root`` (a task image's root filesystem,
        whose absolute links point into the image, not at the host: only their presence
        is checked there)."""
        present = os.path.exists if root == "/" else os.path.lexists
        return [tool for tool in self.tools if not present(os.path.join(root, tool.lstrip("/")))]

    def compile_argv(self, step: Step) -> list[str] | None:
        """The compile command, or None for a language without a compile step."""
        return None

    def run_argv(self, step: Step) -> list[str]:
        raise NotImplementedError

    def compile_env(self, step: Step) -> dict[str, str]:
        return {"PATH": PATH}

    def run_env(self, step: Step) -> dict[str, str]:
        return {"PATH": PATH}


def packed(command: list[str], outputs: str) -> list[str]:
    """``command``, then its outputs archived for the run (only when it succeeded: the
    compile's exit status and messages are the compiler's)."""
    return ["/bin/sh", "-c", f"{shlex.join(command)} && exec /usr/bin/tar -cf {BUILD_ARCHIVE} {outputs}"]


class Python(Language):
    name = LanguageName.python
    source = "main.py"
    package = "python3"
    version = ("/usr/bin/python3", "--version")
    in_process = True
    address_space_error = True

    def run_argv(self, step: Step) -> list[str]:
        return ["/usr/bin/python3", self.source]  # what in_process stands for


class Bash(Language):
    name = LanguageName.bash
    source = "main.sh"
    package = "bash"
    version = ("/bin/bash", "--version")

    def run_argv(self, step: Step) -> list[str]:
        return ["/bin/bash", self.source]


class C(Language):
    name = LanguageName.c
    source = "main.c"
    package = "gcc"
    version = ("/usr/bin/gcc", "--version")

    def compile_argv(self, step: Step) -> list[str]:
        return packed(["/usr/bin/gcc", self.source, "-o", "main", "-lm"], "main")

    def run_argv(self, step: Step) -> list[str]:
        return ["./main"]


def _ssl_libs() -> list[str]:
    """SandboxFusion links C++ with OpenSSL where it can (libssl-dev installed)."""
    have = all(os.path.exists(f"{LIB_DIR}/lib{name}.so") for name in ("ssl", "crypto"))
    return ["-lcrypto", "-lssl"] if have else []


class Cpp(Language):
    name = LanguageName.cpp
    source = "main.cpp"
    package = "g++ libssl-dev"
    version = ("/usr/bin/g++", "--version")
    cache = "cpp"  # precompiled <bits/stdc++.h> and <iostream>

    def __init__(self) -> None:
        self.libs = [*_ssl_libs(), "-lpthread"]

    def compile_argv(self, step: Step) -> list[str]:
        # SandboxFusion's flags; a precompiled header is found first on the -I directory
        # and used when the program's first include is that header.
        pch = ["-I", f"{step.cache}/include"] if step.cache else []
        return packed(["/usr/bin/g++", "-std=c++17", *pch, self.source, "-o", "main", *self.libs], "main")

    def run_argv(self, step: Step) -> list[str]:
        return ["./main"]


class Rust(Language):
    name = LanguageName.rust
    source = "main.rs"
    package = "rustc"
    version = ("/usr/bin/rustc", "--version")

    def compile_argv(self, step: Step) -> list[str]:
        # SandboxFusion's ``rustc FILE -o test`` (edition 2015, no optimisation); the
        # standard library's debug information stripped from the binary (a tenth of its size).
        return packed(["/usr/bin/rustc", self.source, "-o", "main", "-C", "strip=debuginfo"], "main")

    def run_argv(self, step: Step) -> list[str]:
        return ["./main"]


class Go(Language):
    name = LanguageName.go
    source = "main.go"
    package = "golang-go"
    version = ("/usr/bin/go", "version")
    cache = "go"  # a build cache (the standard library is Debian's, precompiled in GOROOT/pkg)

    def compile_argv(self, step: Step) -> list[str]:
        return packed(["/usr/bin/go", "build", "-o", "main", self.source, *step.sources], "main")

    def compile_env(self, step: Step) -> dict[str, str]:
        return {
            "PATH": PATH,
            # Read-only and pre-warmed when ready, else one of the run's own. Go 1.19 keeps
            # an index of GOROOT's packages in the cache, which fails on a read-only one:
            # goindex=0 turns the index off.
            "GOCACHE": f"{step.cache}/gocache" if step.cache else "/tmp/go-build",
            "GODEBUG": "goindex=0",
            "GOPATH": "/tmp/go",
            "GOPROXY": "off",  # no network: a module download fails at once
            "GOFLAGS": "-buildvcs=false",
        }

    def run_argv(self, step: Step) -> list[str]:
        return ["./main"]

    def run_env(self, step: Step) -> dict[str, str]:
        # Go's collector works harder as the heap nears this (a soft limit; past it the
        # cgroup still kills).
        return {"PATH": PATH, "GOMEMLIMIT": f"{heap_mb(step.memory_mb)}MiB"}


class Java(Language):
    name = LanguageName.java
    source = "Main.java"
    package = "openjdk-17-jdk-headless libjavatuples-java"
    version = ("/usr/bin/javac", "-version")
    cache = "java"  # a class-data-sharing archive of javac

    @property
    def tools(self) -> tuple[str, ...]:
        return ("/usr/bin/javac", "/usr/bin/java", *JAVA_CLASSPATH)

    def compile_argv(self, step: Step) -> list[str]:
        # javac is a Java program: its own JVM sized from the compile's limit, one GC
        # thread, the first JIT tier only (a compile is short), and javac's classes mapped
        # from a pre-made CDS archive when ready.
        jvm = [f"-J-Xmx{heap_mb(step.memory_mb)}m", "-J-XX:+UseSerialGC", "-J-XX:TieredStopAtLevel=1",
               "-J-XX:-UsePerfData"]  # fmt: skip
        if step.cache:
            jvm.append(f"-J-XX:SharedArchiveFile={step.cache}/javac.jsa")
        classpath = ":".join([".", *JAVA_CLASSPATH])
        javac = ["/usr/bin/javac", *jvm, "-encoding", "UTF-8", "-cp", classpath, "-d", ".temper-classes",
                 self.source]  # fmt: skip
        return packed(javac, "-C .temper-classes .")

    def run_argv(self, step: Step) -> list[str]:
        # SandboxFusion's ``java -cp . -ea Main`` (assertions on), with the heap from the
        # run's limit (a JVM sizes it from the host's memory otherwise) and one GC thread.
        classpath = ":".join([".", *JAVA_CLASSPATH])
        return ["/usr/bin/java", f"-Xmx{heap_mb(step.memory_mb)}m", "-XX:+UseSerialGC", "-XX:-UsePerfData",
                "-ea", "-cp", classpath, "Main"]  # fmt: skip


class NodeJs(Language):
    name = LanguageName.nodejs
    source = "main.js"
    package = "nodejs"
    version = ("/usr/bin/node", "--version")

    def run_argv(self, step: Step) -> list[str]:
        return ["/usr/bin/node", f"--max-old-space-size={heap_mb(step.memory_mb)}", self.source]


class TypeScript(Language):
    """Run as SandboxFusion runs it (tsx): the types stripped, not checked, then the
    JavaScript run in the same process; no compile step. Temper's runner
    (``compile_cache.TS_RUNNER``) transpiles with Debian's TypeScript, whose compiled code
    comes from a V8 code cache made for the run's heap size when ready."""

    name = LanguageName.typescript
    source = "main.ts"
    package = "nodejs node-typescript"
    version = ("/usr/bin/tsc", "--version")
    cache = "typescript"

    def __init__(self, runner: str) -> None:
        self.runner = runner  # where the runner script is inside the sandbox

    @property
    def tools(self) -> tuple[str, ...]:
        return ("/usr/bin/node", TYPESCRIPT_JS)

    def run_argv(self, step: Step) -> list[str]:
        heap = heap_mb(step.memory_mb)
        cache = f"{step.cache}/heap-{heap}.cache" if step.cache else ""
        return ["/usr/bin/node", f"--max-old-space-size={heap}", self.runner, cache, self.source]


def registry(ts_runner: str) -> dict[LanguageName, Language]:
    """Every language, by name (``ts_runner``: where sandboxes see the TypeScript runner)."""
    table: list[Language] = [
        Python(),
        Bash(),
        C(),
        Cpp(),
        Java(),
        Go(),
        Rust(),
        NodeJs(),
        TypeScript(ts_runner),
    ]
    return {lang.name: lang for lang in table}
