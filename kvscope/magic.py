"""``%kvscope`` / ``%%kvscope``: the dashboard from one line of a notebook (``%load_ext kvscope``)."""
from __future__ import annotations

import keyword
import re
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display
from IPython.utils.process import arg_split

from kvscope.trace import Trace
from kvscope.widgets.views import VIEW_CLASSES


@magics_class
class KvscopeMagics(Magics):
    @magic_arguments()
    @argument("target", nargs="?", default=None,
              help="an LLM or a Trace variable, or 'demo'. In cell mode: the LLM to watch "
                   "(default: the only LLM in the namespace).")
    @argument("endpoints", nargs="*", default=[],
              help="with 'attach': the vLLM KV-event publishers to watch (tcp://host:5557 ...)")
    @argument("--topic", default="kv-events", help="with 'attach': the publishers' topic")
    @argument("--replay", default=None, help="with 'attach': replay endpoints, comma-separated, one per publisher")
    @argument("--metrics", default=None, help="with 'attach': Prometheus /metrics URLs, comma-separated, one per publisher")
    @argument("-o", "--out", default=None,
              help="store the recorded Trace in this variable (with 'attach': the attached source)")
    @argument("--views", default=None,
              help=f"comma-separated views to show, from: {', '.join(VIEW_CLASSES)} (default: all, or the "
                   "timeline alone for a summary recording)")
    @argument("--level", default="blocks", choices=("summary", "blocks", "full"),
              help="recording level (the block views need 'blocks' or 'full')")
    @argument("--max-steps", type=int, default=2000, help="steps the recording keeps (a ring buffer)")
    @argument("--interval", type=float, default=0.25, help="least seconds between two browser updates")
    @argument("--max-load", type=float, default=0.02,
              help="largest share of the time live updates may take (they share the GIL with the engine)")
    @argument("--html", default=None,
              help="also write a static HTML export of the trace to this file (of a Trace, or in cell mode)")
    @line_cell_magic
    def kvscope(self, line: str, cell: str | None = None) -> Any:
        """Show kvscope's dashboard: the KV block pool, queues, block tables, slot mapping, timeline.

        %kvscope llm            live dashboard of LLM `llm`: later llm.generate(...) calls update it
        %kvscope trace          replay a recorded or loaded Trace with a step slider
        %kvscope demo           LLM() on the bundled model, running a demo workload in the background
        %kvscope attach tcp://host:5557 [--replay tcp://host:5558] [--metrics http://host:8000/metrics] -o src
                                watch a vLLM deployment's prefix caches from its KV events (docs/ATTACH.md)
        %%kvscope [llm] -o t    run the cell with a live dashboard; the recorded Trace is stored in `t`
        """
        args = self._parse(line)
        if cell is not None and args.target in _LINE_ONLY:  # (the cell would never run)
            raise UsageError(f"%%kvscope {args.target}: not in cell mode, which watches the cell's own LLM; "
                             f"use the line magic %kvscope {args.target} ...")
        if args.target == "attach":
            return self._attach(args)
        if args.endpoints:
            raise UsageError(f"%kvscope: unexpected arguments {args.endpoints} (only 'attach' takes endpoints)")
        options = dict(views=args.views, level=args.level,
                       max_steps=args.max_steps, interval=args.interval, max_load=args.max_load)
        from kvscope.demo import demo
        from kvscope.widgets import Dashboard

        if cell is not None:
            dash = _built(Dashboard, self._llm(args.target), **options)
            display(dash)
            try:
                self.shell.run_cell(cell)
            finally:
                dash.detach()
        elif args.target is None:
            raise UsageError("usage: %kvscope llm | %kvscope trace | %kvscope demo (see %kvscope?)")
        else:  # (--html: a live dashboard would export the nothing it recorded so far, then stay attached)
            source = None if args.target == "demo" else _source(args.target, self._resolve(args.target))
            if args.html and not isinstance(source, Trace):
                raise UsageError("%kvscope: --html exports a recorded Trace, and a live dashboard has recorded "
                                 "nothing yet: give it a Trace, or use it in cell mode (%%kvscope --html ...)")
            if args.html and source.level == "summary":
                raise UsageError("%kvscope: --html exports the block views, and this trace was recorded at level "
                                 "'summary'")
            if args.html and not source.step_ids:
                raise UsageError("%kvscope: --html: the trace holds no engine step, so there is no page to write")
            live_only = self._given(args, _LIVE_ONLY)
            if isinstance(source, Trace) and live_only:
                raise UsageError(f"%kvscope: {_flags(live_only)}: only with a live dashboard (an LLM, or demo); "
                                 "a Trace replays what it recorded")
            dash = _built(demo, **options) if args.target == "demo" else _built(Dashboard, source, **options)
        if args.out:
            self.shell.user_ns[args.out] = dash.trace
        if args.html and not dash.trace.step_ids:  # (the cell failed, was interrupted, or does not generate)
            raise UsageError("%%kvscope: --html: the cell ran no engine step, so there is no page to write")
        if args.html:
            dash.to_html(args.html)
        return None if cell is not None else dash

    def _parse(self, line: str) -> Any:
        """The magic's arguments, refused whole (nothing built yet) when they do not fit: an
        unclosed quote, an ``-o`` that is no variable name (or the target's), a ``--html``
        that is no file name (empty, or a directory), into no directory or of a ``summary``
        recording, or options of ``attach`` without it (and the other way round). An argument in quotes is read
        without them, as a shell reads it; one that only holds quotes stays as written (the
        target is an expression: ``d['t']``)."""
        try:
            argv = arg_split(line, posix=False, strict=True)
        except ValueError as e:  # (shlex: an unclosed quote)
            raise UsageError(f"%kvscope: {e} in {line!r}") from None
        args = self.kvscope.parser.parse_args([_QUOTED.sub(r"\1\3", a) for a in argv])
        if args.out is not None and not (args.out.isidentifier() and not keyword.iskeyword(args.out)):
            raise UsageError(f"%kvscope: -o/--out must be a variable name, got {args.out!r}")
        if args.out is not None and args.out == args.target:
            raise UsageError(f"%kvscope: -o {args.out} would replace the target {args.target} with what it records; "
                             "name another variable")
        if args.html is not None and (not args.html or Path(args.html).is_dir()):
            raise UsageError(f"%kvscope: --html {args.html!r}: not a file name to write the page to")
        if args.html is not None and args.level == "summary":
            raise UsageError("%kvscope: --html exports the block views: it needs --level blocks or full")
        if args.html is not None and not Path(args.html).parent.is_dir():
            raise UsageError(f"%kvscope: --html {args.html!r}: no directory {str(Path(args.html).parent)!r} to write it in")
        attach = args.target == "attach"
        wrong = self._given(args, _NOT_ATTACH if attach else _ATTACH_ONLY)
        if wrong:
            raise UsageError(f"%kvscope: {_flags(wrong)}: {'not' if attach else 'only'} with 'attach' (see %kvscope?)")
        return args

    def _given(self, args: Any, names: tuple[str, ...]) -> list[str]:
        """Those of the options ``names`` the line set to other than their defaults."""
        parser = self.kvscope.parser
        return [name for name in names if getattr(args, name) != parser.get_default(name)]

    def _attach(self, args: Any) -> Any:
        """``%kvscope attach ...``: ``kvscope.attach`` the endpoints and show ``kvscope.dashboard`` of it."""
        import kvscope

        if not args.endpoints:
            raise UsageError("usage: %kvscope attach tcp://host:5557 [tcp://host2:5557 ...] (see %kvscope?)")
        split = lambda v: [x.strip() for x in v.split(",") if x.strip()] if v else None  # noqa: E731
        attached = _built(kvscope.attach, args.endpoints, topic=args.topic, replay_endpoints=split(args.replay),
                          metrics_urls=split(args.metrics))
        # (--interval's default is the live dashboard's; the attach dashboard keeps its own unless given)
        given = self._given(args, ("interval",))
        try:
            dash = _built(kvscope.dashboard, attached, **{name: getattr(args, name) for name in given})
        except BaseException:  # (the subscription runs in a thread of its own: nobody else could close it)
            attached.close()
            raise
        if args.out:
            self.shell.user_ns[args.out] = attached
        return dash

    def _resolve(self, name: str) -> Any:
        """The value of the target expression ``name`` in the notebook; one that fails to
        evaluate is refused naming it, with the error it raised chained (a name that is a
        directory, as ``Trace.save`` writes, is told how to load it)."""
        try:
            return eval(name, self.shell.user_ns)  # noqa: S307 - the user's own expression
        except NameError:
            hint = f" (a saved trace? t = kvscope.Trace.load({name!r}), then %kvscope t)" if Path(name).is_dir() else ""
            raise UsageError(f"%kvscope: {name!r} is not defined in the notebook{hint}") from None
        except Exception as e:
            raise UsageError(f"%kvscope: the target {name!r} raised {type(e).__name__}: {e}") from e

    def _llm(self, name: str | None) -> Any:
        """The LLM that cell mode watches: ``name``'s, or the only one in the namespace."""
        if name is not None:
            source = self._resolve(name)
            if isinstance(source, Trace):
                raise UsageError(f"%%kvscope: {name!r} is a Trace; cell mode records an LLM while the cell "
                                 f"runs (replay a Trace with %kvscope {name})")
            return _source(name, source)
        from kvscope.llm import LLM

        found = [k for k, v in self.shell.user_ns.items() if isinstance(v, LLM) and not k.startswith("_")]
        if len(found) != 1:
            raise UsageError(
                f"%%kvscope: name the LLM to watch (found {len(found)} LLM variables: {', '.join(found) or 'none'})"
            )
        return self.shell.user_ns[found[0]]


def _source(name: str, value: Any) -> Any:
    """``value``, the target ``name``'s, if a dashboard can show it (an LLM or a Trace); else
    refused naming the target (the dashboard's own TypeError named neither)."""
    if isinstance(value, Trace) or hasattr(value, "record"):
        return value
    raise UsageError(f"%kvscope: the target {name!r} is of type {type(value).__name__}, not an LLM or a kvscope.Trace")


def _built(make: Any, *args: Any, **options: Any) -> Any:
    """``make(*args, **options)``, its refusal of an option told with the option's flag (the
    dashboard and ``kvscope.attach`` name their Python arguments: ``max_steps must be ...``)."""
    try:
        return make(*args, **options)
    except ValueError as e:
        raise UsageError("%kvscope: " + _OPTION_NAME.sub(lambda m: _flags([m[1]]), str(e))) from e


def _flags(names: list[str]) -> str:
    """Options' Python names as the magic's flags: ``max_steps`` -> ``--max-steps``."""
    return ", ".join(_FLAG_OF.get(name, "--" + name.replace("_", "-")) for name in names)


# A refusal that starts with the option it refuses.
_OPTION_NAME = re.compile(r"^(max_steps|max_load|interval|views|replay_endpoints|metrics_urls)\b")
_FLAG_OF = {"replay_endpoints": "--replay", "metrics_urls": "--metrics"}  # kvscope.attach's names for them
# An argument wholly in matching quotes, or an option's value after "=" in them.
_QUOTED = re.compile(r"""^(-[\w-]+=)?(['"])(.*)\2$""", re.DOTALL)
_ATTACH_ONLY = ("topic", "replay", "metrics")
_NOT_ATTACH = ("views", "level", "max_steps", "max_load", "html")
_LIVE_ONLY = ("level", "max_steps", "interval", "max_load")  # what a replay of a Trace leaves unused
_LINE_ONLY = ("attach", "demo")  # targets that bring their own source, with no cell to run


def load_ipython_extension(ipython: Any) -> None:
    """Register the ``%kvscope`` line and cell magic."""
    ipython.register_magics(KvscopeMagics)
