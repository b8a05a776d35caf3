"""Log lines a target can make us write again and again, kept few.

A target decides how often an ANA state flips, an asynchronous event comes, a keep-alive
fails or a reconnect is refused; one line for each of those let it fill the log.  So, as
the kernel's ``printk_ratelimit`` and ``dev_warn_ratelimited``:

- :class:`RateLimitedLog` writes at most ``burst`` lines of one kind (a key) per
  ``interval`` seconds and counts the rest; the next line of that kind to pass says how
  many were left out ("... and 1,204 more in the last 10 s"), or :func:`report_suppressed`
  does, called every interval by the daemon.  Its keys are bounded (least recently used
  ones go, their count said).
- :class:`FailureStreak` is one failure that repeats (a keep-alive answered with an error,
  reconnects that fail): logged when it starts, then 1, 2, 4 ... up to 60 s apart with how
  often and how long, and its end is said by the caller's own line (:meth:`end`).
- :func:`brief_list` gives a long list's first few and a count, and :class:`LineCap` cuts
  any line past :data:`MAX_LINE` characters, so that no line is a list of 65,536 names.

Nothing here imports anything of ours: every layer above ``nvme/`` logs through it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

INTERVAL = 10.0
"""Seconds of one rate-limit window (the kernel's DEFAULT_RATELIMIT_INTERVAL is 5 s)."""
BURST = 5
"""Lines of one kind written per window (the kernel's DEFAULT_RATELIMIT_BURST is 10)."""
MAX_KEYS = 64
"""Kinds one limiter keeps count of; the least recently used goes first."""
FIRST_GAP = 1.0
"""Seconds between a failure's first line and its second, doubling from there ..."""
LONGEST_GAP = 60.0
"""... up to this many seconds between the lines of one failure that goes on."""
MAX_LINE = 4096
"""Characters of one log line at the most (:class:`LineCap`)."""
LIST_SHOWN = 8
"""Items a long list names before its count (:func:`brief_list`)."""

Clock = Callable[[], float]
_limiters: weakref.WeakSet[RateLimitedLog] = weakref.WeakSet()


class _Window:
    __slots__ = ("start", "written", "suppressed", "level", "msg", "args")

    def __init__(self, start: float) -> None:
        self.start = start
        self.written = 0
        self.suppressed = 0
        self.level = logging.NOTSET
        self.msg = ""
        self.args: tuple = ()


def _more(n: int, seconds: float) -> tuple[str, tuple]:
    return " ... and %s more in the last %s s", (f"{n:,}", f"{max(seconds, 1):.0f}")


class RateLimitedLog:
    """``logger``'s lines, at most ``burst`` of each kind per ``interval`` seconds.

    ``log(key, level, msg, *args)`` is ``logger.log(level, msg, *args)`` unless ``burst``
    lines of ``key`` were written in the current window; then it only counts.  Keys name
    kinds of message chosen in the code (with a path's or controller's name at most), never
    a value from the wire, and at most ``max_keys`` are kept.  One limiter serves every
    thread (a companion client's controllers each run a loop of their own).
    """

    def __init__(self, logger: logging.Logger, *, interval: float = INTERVAL,
                 burst: int = BURST, max_keys: int = MAX_KEYS, clock: Clock = time.monotonic
                 ) -> None:
        self.logger = logger
        self.interval = interval
        self.burst = burst
        self.max_keys = max_keys
        self.clock = clock
        self._windows: OrderedDict[Hashable, _Window] = OrderedDict()
        self._lock = threading.Lock()
        _limiters.add(self)

    def log(self, key: Hashable, level: int, msg: str, *args: object) -> bool:
        """Write the line unless its kind is over its burst; whether it was written."""
        if not self.logger.isEnabledFor(level):
            return False
        with self._lock:
            msg, args, write = self._count(key, level, msg, args)
        if write:
            self.logger.log(level, msg, *args)
        return write

    def _count(self, key: Hashable, level: int, msg: str, args: tuple
               ) -> tuple[str, tuple, bool]:
        """Count the line in its kind's window: (its text, its args, whether to write it)."""
        now = self.clock()
        windows = self._windows
        window = windows.get(key)
        if window is None:
            window = windows[key] = _Window(now)
            if len(windows) > self.max_keys:
                self._report(windows.popitem(last=False)[1], now)
        else:
            windows.move_to_end(key)
            if now - window.start >= self.interval:
                if window.suppressed:  # this line says what the last window left out
                    more, more_args = _more(window.suppressed, now - window.start)
                    msg, args = msg + more, (*args, *more_args)
                window.start, window.written, window.suppressed = now, 0, 0
        if window.written < self.burst:
            window.written += 1
            return msg, args, True
        window.suppressed += 1
        window.level, window.msg, window.args = level, msg, args
        return msg, args, False

    def report_suppressed(self, *, final: bool = False) -> int:
        """Say what each kind whose window has ended (every kind, if ``final``) left out:
        its last line, and the count; forget the kinds that went quiet.  Lines written."""
        now = self.clock()
        written = 0
        with self._lock:
            for key, window in list(self._windows.items()):
                if now - window.start < self.interval and not final:
                    continue
                written += self._report(window, now)
                del self._windows[key]
        return written

    def forget(self) -> None:
        """Start afresh: no kind has written or left out anything (what it left out is
        not said)."""
        with self._lock:
            self._windows.clear()

    def _report(self, window: _Window, now: float) -> int:
        if not window.suppressed:
            return 0
        more, more_args = _more(window.suppressed - 1, now - window.start)
        if window.suppressed == 1:  # the one left out, as it was
            more, more_args = "", ()
        self.logger.log(window.level, window.msg + more, *window.args, *more_args)
        window.suppressed = 0
        return 1


def report_suppressed(*, final: bool = False) -> int:
    """:meth:`RateLimitedLog.report_suppressed` of every limiter; lines written."""
    return sum(limiter.report_suppressed(final=final) for limiter in list(_limiters))


def forget_all() -> None:
    """:meth:`RateLimitedLog.forget` of every limiter (a test's fresh start, as a new
    process has)."""
    for limiter in list(_limiters):
        limiter.forget()


class FailureStreak:
    """One failure that may repeat for ever, logged when it starts, then ever more rarely.

    :meth:`failed` writes the first failure's line, then one when ``first_gap`` seconds
    have passed since the last written, doubling up to ``longest_gap``, each with how many
    failed and for how long; :meth:`end` tells the caller's line how long it lasted.
    """

    def __init__(self, logger: logging.Logger, *, first_gap: float = FIRST_GAP,
                 longest_gap: float = LONGEST_GAP, clock: Clock = time.monotonic) -> None:
        self.logger = logger
        self.first_gap = first_gap
        self.longest_gap = longest_gap
        self.clock = clock
        self.count = 0
        self.since = 0.0
        self._gap = first_gap
        self._next = 0.0

    @property
    def failing(self) -> bool:
        return self.count > 0

    def failed(self, level: int, msg: str, *args: object) -> bool:
        """One more failure; its line if one is due (whether it was written)."""
        now = self.clock()
        self.count += 1
        if self.count == 1:
            self.since, self._gap, self._next = now, self.first_gap, now + self.first_gap
        elif now < self._next:
            return False
        else:
            msg += " (%s failures in %s s)"
            args = (*args, f"{self.count:,}", f"{now - self.since:.0f}")
            self._gap = min(self._gap * 2, self.longest_gap)
            self._next = now + self._gap
        self.logger.log(level, msg, *args)
        return True

    def end(self) -> str:
        """The streak is over: "" if there was none, else " after N failures in T s" for
        the caller's line that says so."""
        if not self.count:
            return ""
        count, seconds = self.count, self.clock() - self.since
        self.count = 0
        return f" after {count:,} failure{'s' if count != 1 else ''} in {seconds:.0f} s"


def brief_list(items: Iterable[str], shown: int = LIST_SHOWN) -> str:
    """``items`` joined by commas; past ``shown``, the first ``shown`` and a count
    ("n1, n2, ... n8 and 65,528 more"), so that a line stays short however many."""
    first: list[str] = []
    more = 0
    for item in items:
        if len(first) < shown:
            first.append(item)
        else:
            more += 1
    text = ", ".join(first)
    return f"{text} and {more:,} more" if more else text


class LineCap(logging.Filter):
    """Cuts a record's message past ``limit`` characters (the last resort behind
    :func:`brief_list`: a long value from the wire, a list nobody shortened)."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info or record.stack_info:  # a traceback is many lines anyway
            return True
        text = record.getMessage()
        if len(text) > self.limit:
            keep = max(self.limit - 40, 0)  # room for the note of what was cut
            record.msg = f"{text[:keep]} ... ({len(text) - keep:,} more characters)"
            record.args = None
        return True


def cap_lines(limit: int = MAX_LINE) -> None:
    """Put a :class:`LineCap` on every handler of the root logger (after basicConfig)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, LineCap) for f in handler.filters):
            handler.addFilter(LineCap(limit))
