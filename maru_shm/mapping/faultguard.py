"""Turns a SIGBUS inside a pool mapping into an error of that store instead of the death of the process.

A page of a shared file mapping past the end of its file (someone truncated the pool) or on a full
tmpfs delivers SIGBUS to the thread touching it, which kills an SGLang server; no signal may escape the
store (docs/DESIGN.md section 10).
The size check at every call (Store._check_intact) closes the window between calls; this closes the
window inside a call. On SIGBUS at an address inside a registered mapping, the handler maps one private
zero page over the faulting page (MAP_FIXED) and returns: the access completes on zeros, the store is
marked damaged, and the call in flight raises PoolDamagedError on its way out instead of returning what it
read. A SIGBUS anywhere else is handed back to the previous action (default: the process dies, as before).

The handler is a ctypes callback, so it runs Python in signal context: it only reads a tuple of ranges,
calls mmap through ctypes and bumps a counter, and it never takes a lock. Linux x86-64 and aarch64 (glibc
struct layouts).
"""

from __future__ import annotations

import ctypes
import mmap
import signal

from ..locking.guard import guard

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)

SA_SIGINFO = 4
SA_ONSTACK = 0x08000000
PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


class _SigInfo(ctypes.Structure):
    _fields_ = [("si_signo", ctypes.c_int), ("si_errno", ctypes.c_int), ("si_code", ctypes.c_int),
                ("_pad", ctypes.c_int), ("si_addr", ctypes.c_void_p)]


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(_SigInfo), ctypes.c_void_p)


class _SigAction(ctypes.Structure):
    _fields_ = [("sa_handler", ctypes.c_void_p), ("sa_mask", ctypes.c_ulong * 16), ("sa_flags", ctypes.c_int),
                ("sa_restorer", ctypes.c_void_p)]


class Guarded:
    """One registered mapping: [start, end) and how many faults were absorbed in it."""
    __slots__ = ("start", "end", "faults")

    def __init__(self, start: int, end: int):
        self.start, self.end, self.faults = start, end, 0


_ranges: tuple = ()          # of Guarded; replaced whole (never mutated) so the handler reads it lock-free
_lock = guard()  # serialises register/unregister and installation
_previous = _SigAction()
_previous_set = False  # the handler has been installed once (`_previous` holds what it replaced)
_DEFAULT = None  # sa_handler of the default action (SIG_DFL), as ctypes reads a NULL c_void_p


def _on_sigbus(signo, info, context):
    addr = info.contents.si_addr or 0
    for g in _ranges:
        if g.start <= addr < g.end:
            page = addr - addr % PAGE
            _libc.mmap(page, PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                       mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)  # 0x10: MAP_FIXED
            g.faults += 1
            return
    _libc.sigaction(signal.SIGBUS, ctypes.byref(_previous), None)  # not ours: the fault repeats, as before


_handler = _HANDLER(_on_sigbus)  # kept alive for the life of the process


def _install() -> None:
    """Make the handler SIGBUS's action the first time, and again whenever the action has been reset to the
    default since (`signal.signal(SIGBUS, SIG_DFL)`, or faulthandler.disable() where faulthandler was enabled
    before us): a guarded mapping must never meet the default. Any other action is left alone: it may be a
    handler that chains to ours, and chaining back to it would loop."""
    global _previous_set
    current = _SigAction()
    if _previous_set and (_libc.sigaction(signal.SIGBUS, None, ctypes.byref(current)) != 0
                          or current.sa_handler != _DEFAULT):
        return
    ours = ctypes.cast(_handler, ctypes.c_void_p).value
    act = _SigAction()
    act.sa_handler = ours
    act.sa_flags = SA_SIGINFO | SA_ONSTACK
    if _libc.sigaction(signal.SIGBUS, ctypes.byref(act), ctypes.byref(_previous)) != 0:
        raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) failed")
    _previous_set = True


def register(start: int, length: int) -> Guarded:
    """Guard [start, start + length): a SIGBUS there is absorbed and counted in the returned record."""
    global _ranges
    g = Guarded(start, start + length)
    with _lock:
        _install()
        _ranges = _ranges + (g,)
    return g


def unregister(g: Guarded) -> None:
    """Before the mapping goes away: its addresses may be reused by another mapping."""
    global _ranges
    with _lock:
        _ranges = tuple(r for r in _ranges if r is not g)
