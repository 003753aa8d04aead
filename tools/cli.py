"""`maru-shm`: create, inspect, check, watch and destroy a maru_shm pool file.

    maru-shm create  PATH --size 4G [--mode 0660]
    maru-shm inspect PATH [--json]
    maru-shm check   PATH [--repair]
    maru-shm watch   PATH [--interval S] [--count N] [--json]
    maru-shm destroy PATH [--force]
    maru-shm bench   [ARGS...]          (tools/benchmarks/, when installed)

Exit status: 0 ok; 1 the pool is not in the state asked about (check found
problems, destroy refused because live processes are attached); 2 the command
could not run (not a pool, no such file, permission, bad arguments), with one
line on stderr. `inspect` and `watch` map the pool read-only and take no lock;
only `check --repair` and `destroy` change it (see docs/CLI.md).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time

from .cliparser import PLAN_KNOBS, PROG, build_parser, open_defaults

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2
# The modules that only an extra of pyproject.toml installs, and that extra: a command that imports one of
# them where it is missing says which extra to install instead of failing as an internal error.
EXTRA_OF_MODULE = {"sglang": "sglang", "torch": "sglang", "matplotlib": "charts"}


class CliError(Exception):
    """A condition that ends the command with a one-line message and exit status 2."""


# --------------------------------------------------------------------------- output
def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _console(stderr: bool = False):
    from rich.console import Console
    return Console(stderr=stderr, highlight=False)


def _print(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _warn(text: str) -> None:
    sys.stderr.write(f"{PROG}: {text}\n")


# --------------------------------------------------------------------------- create
def cmd_create(args) -> int:
    from maru_shm import Store
    from . import render
    path = args.path
    device = False
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise CliError(f"{path} is a symlink; give the pool's real path")
        device = stat.S_ISCHR(st.st_mode)
        if not device:
            raise CliError(f"{path} already exists; remove it with `{PROG} destroy {path}` first")
    if args.size is None and not device:
        raise CliError("--size is required to create a pool file (e.g. --size 4G)")
    knobs = {k: getattr(args, k) for k in PLAN_KNOBS if getattr(args, k) is not None}
    if not device:
        # Plan first: Store.open creates the file before it finds out that the size cannot work.
        from maru_shm import plan_pool
        try:
            plan_pool(args.size, **{**open_defaults(), **knobs})
        except ValueError as e:
            raise CliError(f"cannot create a pool at {path}: {e}") from None
    store = Store.open(path, size=None if device else args.size, create=True, mode=args.mode,
                       eviction=args.eviction, **knobs)
    try:
        created, g = store.created, store.geo
    finally:
        store.close()
    if not created:
        raise CliError(f"{path} already holds a maru-shm pool; destroy it first to recreate it")
    _print(f"created {path}: {render.size(g.file_size)}, data {render.size(g.data_bytes)} in "
           f"{g.n_units} units of {render.size(g.unit_size)}, granule {render.size(g.granule)}, "
           f"index {g.index_slots} slots, "
           f"{g.proc_slots} process slots, {args.eviction} eviction, mode {args.mode:04o}")
    return EXIT_OK


# --------------------------------------------------------------------------- inspect
def _report(view) -> dict:
    """The pool's report, plus the second tier's figures of the processes attached to it (maru_tier2)."""
    from maru_shm import pool_report
    from maru_sglang.tiers.status import read_statuses
    rep = pool_report(view)
    rep["tier2"] = read_statuses(rep["path"], [p["pid"] for p in rep["processes"] if p["alive"] is not False])
    return rep


def cmd_inspect(args) -> int:
    from maru_shm import PoolView
    from . import render
    with PoolView.open(args.path) as view:
        rep = _report(view)
    if args.json:
        _print(json.dumps(rep, indent=2, sort_keys=False))
    elif _is_tty(sys.stdout):
        console = _console()
        console.print(render.to_rich(render.sections(rep), width=console.width))
    else:
        sys.stdout.write(render.to_plain(render.sections(rep)))
    return EXIT_OK


# --------------------------------------------------------------------------- check
class _Progress:
    """A progress bar on stderr for `check`: only on a terminal, and only once the check has run for
    DELAY seconds (a small pool is done before anything is drawn). check_live reports size classes as it
    goes; the index pass that follows has no count, so the bar then shows elapsed time only."""

    DELAY = 0.5

    def __init__(self, enabled: bool):
        self.bar = self.timer = self.index_task = None
        if not enabled:
            return
        import threading

        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn)
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=_console(stderr=True), transient=True)
        self.task = self.bar.add_task("taking locks", total=None)
        self.timer = threading.Timer(self.DELAY, self.bar.start)
        self.timer.daemon = True
        self.timer.start()

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            return
        self.bar.update(self.task, completed=done, total=total, description="checking size classes")
        if done >= total and self.index_task is None:
            self.index_task = self.bar.add_task("checking index entries and process table", total=None)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()
        if self.bar is not None:
            self.bar.stop()
        self.bar = self.timer = None


def cmd_check(args) -> int:
    from maru_shm import check_pool, repair_pool
    tty = _is_tty(sys.stderr)
    # The check itself is read-only (it never writes, and writers keep working while it runs); only
    # --repair attaches.
    progress = _Progress(tty)
    try:
        first = check_pool(args.path, timeout=args.timeout, progress=progress)
    finally:
        progress.stop()
    after = None
    if args.repair and not first.ok:
        progress = _Progress(tty)
        try:
            after = repair_pool(args.path, timeout=args.timeout, progress=progress)
        finally:
            progress.stop()
    rc = EXIT_OK if (after or first).ok else EXIT_PROBLEMS
    args._rc = rc
    scope = f"{first.checked_blocks:,} blocks, {first.checked_entries:,} index entries"
    for p in first.problems:
        _print(f"problem: {p}")
    if first.unlocked:
        _print(f"note: checked without locks: this user may not reach the lock file of {args.path} (only its "
               "writers may), so findings about parts that writers were changing may be passing states, and "
               "no process's liveness is known")
    if first.to_reap:
        _print(f"note: {len(first.to_reap)} thing(s) left by exited processes, which the next process to open "
               f"the pool reaps (not damage); the first: {first.to_reap[0]}")
    if first.ok:
        _print(f"{args.path}: ok ({scope})")
    else:
        _print(f"{args.path}: {len(first.problems)} problem(s) found ({scope})")
    if after is not None:
        _print(f"repair: {after.repaired} fix(es) made")
        for p in after.problems:
            _print(f"still wrong after repair: {p}")
        _print(f"{args.path}: {'ok after repair' if after.ok else f'{len(after.problems)} problem(s) remain'}")
    elif args.repair:
        _print("repair: nothing to repair")
    return rc


# --------------------------------------------------------------------------- watch
def cmd_watch(args) -> int:
    from maru_shm import PoolView, StoreError
    from . import render

    view = PoolView.open(args.path)
    tty = _is_tty(sys.stdout) and not args.json
    prev = None
    shown = 0
    live = None
    note = None
    try:
        if tty:
            from rich.live import Live
            live = Live(console=_console(), auto_refresh=False, transient=False, redirect_stdout=False,
                        redirect_stderr=False, vertical_overflow="crop")
            live.start()
        while True:
            if view is not None and view.replaced():
                view.close()
                view = None
                prev = None
            if view is None:
                try:
                    view = PoolView.open(args.path)
                    note = None
                except (StoreError, OSError) as e:
                    note = f"{args.path}: {e}"
            rep = None
            if view is not None:
                try:
                    rep = _report(view)
                except StoreError as e:  # the pool lost pages under the view: look again at the next tick
                    note = f"{args.path}: {e}"
                    view.close()
                    view = None
                    prev = None
            stamp = time.strftime("%H:%M:%S")
            if args.json:
                if rep is not None:
                    _print(json.dumps(rep, separators=(",", ":")))
                    sys.stdout.flush()
            elif tty:
                caption = f"{PROG} watch {args.path}   every {args.interval:g}s   {stamp}   (Ctrl-C to quit)"
                if rep is not None:
                    caption += f"\n{render.size(rep['geometry']['file_bytes'])} pool, format version " \
                               f"{rep['format']['version']}, {rep['geometry']['units']:,} units of " \
                               f"{render.size(rep['geometry']['unit_size'])}"
                if rep is None:
                    from rich.text import Text
                    live.update(Text(f"{caption}\n\n{note}", style="bold"), refresh=True)
                else:
                    live.update(render.to_rich(_watch_sections(rep, prev), caption=caption,
                                               width=live.console.width), refresh=True)
            else:
                _print(f"--- {args.path} {stamp}")
                sys.stdout.write(note + "\n" if rep is None else render.to_plain(_watch_sections(rep, prev)))
                sys.stdout.flush()
            if rep is not None:
                prev = rep
            shown += 1
            if args.count and shown >= args.count:
                return EXIT_OK
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if live is not None:
            live.stop()
        if view is not None:
            view.close()


_WATCH_ORDER = ("Space", "Index", "Counters", "Repair", "Processes", "Size classes")


def _watch_sections(rep, prev):
    """The inspect summary for a live view: the static pool description left out, and the one
    section that can grow long (size classes) last, so a short terminal crops only its tail."""
    from . import render
    by_title = {s.title: s for s in render.sections(rep, prev)}
    return [by_title[t] for t in _WATCH_ORDER if t in by_title]


# --------------------------------------------------------------------------- destroy
def cmd_destroy(args) -> int:
    from maru_shm import PoolInUseError, destroy_pool, is_device
    path = args.path
    device = is_device(path)
    try:
        attached = destroy_pool(path, force=args.force, timeout=args.timeout)
    except PoolInUseError as e:
        _warn(str(e))
        return EXIT_PROBLEMS
    from maru_sglang.tiers.status import remove_all
    remove_all(path)
    if attached:
        who = ", ".join(f"pid {p['pid']} (slot {p['slot']})" for p in attached)
        _warn(f"warning: destroyed {path} while {len(attached)} process(es) were attached: {who}")
    _print(f"destroyed {path}: superblock zeroed (the device is kept)" if device else f"destroyed {path}")
    return EXIT_OK


# --------------------------------------------------------------------------- bench
def cmd_bench(bench_args: list[str]) -> int:
    import importlib
    name = f"{__package__}.benchmarks"
    try:
        # import_module reads sys.modules first; `from . import benchmarks` would prefer the attribute
        # the package got when another caller imported it, so a stand-in in sys.modules would be ignored
        bench = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            _warn("bench is unavailable: the benchmarks package is not installed with this copy of maru-shm")
            return EXIT_ERROR
        raise
    rc = bench.main(bench_args)
    return rc if isinstance(rc, int) else EXIT_OK


COMMANDS = {"create": cmd_create, "inspect": cmd_inspect, "check": cmd_check, "watch": cmd_watch,
            "destroy": cmd_destroy}


def _one_line(e: BaseException) -> str:
    msg = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.strerror:
        msg = f"{e.filename + ': ' if e.filename else ''}{e.strerror}"
    return " ".join(msg.split())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _run(lambda: cmd_bench(argv[1:]), "bench", None)
    args = build_parser().parse_args(argv)
    return _run(lambda: COMMANDS[args.command](args), args.command, args)


def _run(fn, command: str, args) -> int:
    from maru_shm import StoreError
    try:
        rc = fn()
    except CliError as e:
        _warn(f"{command}: {e}")
        rc = EXIT_ERROR
    except (StoreError, OSError) as e:
        if isinstance(e, BrokenPipeError):
            return _broken_pipe(args)
        _warn(f"{command}: {_one_line(e)}")
        rc = EXIT_ERROR
    except KeyboardInterrupt:
        rc = 130
    except Exception as e:  # a missing extra, or a bug: one line and status 2 (a bug's traceback on demand)
        extra = EXTRA_OF_MODULE.get(e.name) if isinstance(e, ModuleNotFoundError) else None
        if extra:
            _warn(f"{command}: needs {e.name}, which is not installed; install maru-shm's [{extra}] extra "
                  f"(pip install 'maru-shm[{extra}]')")
        elif os.environ.get("MARU_SHM_DEBUG"):
            raise
        else:
            _warn(f"{command}: internal error: {type(e).__name__}: {_one_line(e)} "
                  "(set MARU_SHM_DEBUG=1 for a traceback)")
        rc = EXIT_ERROR
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return _broken_pipe(args, rc)
    return rc


def _broken_pipe(args, rc: int | None = None) -> int:
    """The reader of our output went away (`| head`): stop quietly, keep the status already decided."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    if rc is None:
        rc = getattr(args, "_rc", EXIT_OK) if args is not None else EXIT_OK
    return rc


if __name__ == "__main__":
    sys.exit(main())
