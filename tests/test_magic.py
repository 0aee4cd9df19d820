"""``%load_ext kvscope``, ``%kvscope`` and ``%%kvscope`` through IPython's own test shell."""
from __future__ import annotations

import inspect
import re
import threading

import pytest

pytest.importorskip("anywidget")
from IPython.core.error import UsageError  # noqa: E402
from IPython.testing.globalipapp import get_ipython  # noqa: E402

from engine_helpers import make_llm  # noqa: E402

from kvscope import SamplingParams  # noqa: E402
from kvscope.trace import HOOK_POINTS, Trace  # noqa: E402
from kvscope.widgets import Dashboard  # noqa: E402


@pytest.fixture(scope="module")
def ip():
    shell = get_ipython()
    shell.run_line_magic("load_ext", "kvscope")
    shell.user_ns["SamplingParams"] = SamplingParams
    return shell


def test_every_option_reaches_the_dashboard(ip):
    """--views, --level, --max-steps, --interval and --max-load each change what is built
    (-o and --html: the cell-magic test below)."""
    ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    dash = ip.run_line_magic(
        "kvscope", "llm --views timeline --level summary --max-steps 3 --interval 0.5 --max-load 0.1")
    try:
        ip.run_cell("llm.generate('the quick brown fox', SamplingParams(max_tokens=6, temperature=0))")
    finally:
        dash.detach()
    assert set(dash.views) == {"timeline"}
    assert dash.trace.level == "summary"
    steps_run = ip.user_ns["llm"].llm_engine.scheduler.step_count
    assert steps_run >= 6 and dash.trace.step_ids == list(range(steps_run - 2, steps_run + 1))
    assert (dash.interval, dash.max_load) == (0.5, 0.1)


def test_cell_magic_records_the_cell_and_stores_the_trace(ip, tmp_path):
    ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    html = tmp_path / "cell.html"
    result = ip.run_cell_magic(
        "kvscope", f"-o tr --interval 0.01 --html {html}",
        "outs = llm.generate(['the quick brown fox'] * 2, SamplingParams(max_tokens=6, temperature=0))",
    )
    assert result is None
    trace = ip.user_ns["tr"]
    assert isinstance(trace, Trace) and len(trace.step_ids) >= 6
    assert len(ip.user_ns["outs"]) == 2
    assert html.exists() and "kvscope-pool" in html.read_text()
    # the recording ended with the cell: later steps are not in the trace
    ip.run_cell("llm.generate('the quick', SamplingParams(max_tokens=3))")
    assert trace.step_ids[-1] < ip.user_ns["llm"].llm_engine.scheduler.step_count


def test_line_magic_shows_a_live_dashboard_and_replays_a_trace(ip):
    ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    dash = ip.run_line_magic("kvscope", "llm --views pool,queues --interval 0.01")
    assert isinstance(dash, Dashboard) and set(dash.views) == {"pool", "queues"}
    ip.run_cell("llm.generate('the quick brown fox', SamplingParams(max_tokens=4))")
    dash.detach()
    ip.user_ns["t"] = dash.trace
    replay = ip.run_line_magic("kvscope", "t")
    assert replay.llm is None and replay.step == dash.trace.step_ids[-1]


def test_demo_runs_on_the_bundled_model(ip):
    dash = ip.run_line_magic("kvscope", "demo --interval 0.05")
    outputs = dash.run_future.result(timeout=60)
    dash.detach()
    assert len(outputs) == 8 and dash.trace.steps["num_preemptions"].sum() > 0
    assert dash.trace.steps["prefix_cache_hits"].sum() > 0


def test_errors_name_the_fix(ip):
    with pytest.raises(UsageError, match="usage"):
        ip.run_line_magic("kvscope", "")
    with pytest.raises(UsageError, match="nope"):
        ip.run_line_magic("kvscope", "nope")
    with pytest.raises(UsageError, match="--nope"):
        ip.run_line_magic("kvscope", "llm --nope")


@pytest.mark.parametrize("line,cell,says", [
    ("", None, "usage: %kvscope llm"),
    ("nope", None, "'nope' is not defined in the notebook"),
    ("demo extra", None, "unexpected arguments ['extra']"),
    ("attach", None, "usage: %kvscope attach"),
    ("unset", None, "the target 'unset' is of type NoneType, not an LLM or a kvscope.Trace"),
    ("5", None, "the target '5' is of type int, not an LLM or a kvscope.Trace"),
    ("", "x = 1", "%%kvscope: name the LLM to watch (found 0 LLM variables"),
    ("unset", "x = 1", "the target 'unset' is of type NoneType, not an LLM"),
])
def test_a_refused_line_is_one_usage_error_line_not_a_traceback(ip, line, cell, says):
    """Jupyter shows a UsageError as one line, ``UsageError: ...``; these refusals were a
    ValueError, NameError or TypeError, each a traceback through the magic's own code. Nothing
    runs: no cell, no demo, no recording."""
    ip.user_ns.update(unset=None)
    for name in [k for k, v in ip.user_ns.items() if type(v).__name__ == "LLM"]:
        del ip.user_ns[name]
    ip.user_ns.pop("x", None)
    threads = set(threading.enumerate())
    with pytest.raises(UsageError) as refused:
        if cell is None:
            ip.run_line_magic("kvscope", line)
        else:
            ip.run_cell_magic("kvscope", line, cell)
    assert type(refused.value) is UsageError and says in str(refused.value)  # (IPython's test: its exact type)
    assert "x" not in ip.user_ns and set(threading.enumerate()) <= threads


def test_a_target_naming_a_saved_trace_directory_says_how_to_load_it(ip, tmp_path, monkeypatch):
    """``%kvscope saved_trace`` with no such variable, where a directory of that name exists:
    the refusal says to load it with ``kvscope.Trace.load``."""
    (tmp_path / "saved_trace").mkdir()
    monkeypatch.chdir(tmp_path)
    ip.user_ns.pop("saved_trace", None)
    with pytest.raises(UsageError, match=re.escape("kvscope.Trace.load('saved_trace')")):
        ip.run_line_magic("kvscope", "saved_trace")


def test_a_target_that_is_none_or_fails_to_evaluate_is_refused_naming_it(ip):
    """A target variable holding None is refused as no LLM or Trace (it ran the demo, which
    only a bare 'demo' asks for: a background run on the bundled model); a target expression
    that raises is refused naming the expression and its error (a bare KeyError before)."""
    ip.user_ns.update(unset=None, d={})
    threads = set(threading.enumerate())
    with pytest.raises(UsageError, match="the target 'unset' is of type NoneType, not an LLM or a kvscope.Trace"):
        ip.run_line_magic("kvscope", "unset")
    assert set(threading.enumerate()) <= threads  # no demo run started
    for target, error in (("d['t']", "KeyError: 't'"), ("1/0", "ZeroDivisionError")):
        with pytest.raises(UsageError, match=f"^%kvscope: the target {re.escape(repr(target))} raised {error}"):
            ip.run_line_magic("kvscope", target)


@pytest.mark.parametrize("target", ["attach tcp://127.0.0.1:1", "demo"])
def test_cell_mode_refuses_the_targets_of_the_line_magic_before_anything_runs(ip, target):
    """``%%kvscope attach ...`` showed the attach dashboard and dropped the cell unrun;
    ``%%kvscope demo`` looked for a variable named demo. Both are refused by name, pointing at
    the line magic, and the cell does not run."""
    ip.user_ns.pop("ran", None)
    name = target.split()[0]
    with pytest.raises(UsageError, match=f"^%%kvscope {name}: not in cell mode.*%kvscope {name}"):
        ip.run_cell_magic("kvscope", target, "ran = True")
    assert "ran" not in ip.user_ns


def test_quoted_option_values_are_read_as_a_shell_reads_them(ip, tmp_path):
    """``--views "pool,queues"`` shows those views, and ``--html "a b.html"`` writes the file a
    shell would name (the quotes were kept: unknown views, or a file named with its quotes)."""
    ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    dash = ip.run_line_magic("kvscope", "llm --views \"pool,queues\" --interval '0.01'")
    dash.detach()
    assert set(dash.views) == {"pool", "queues"}
    page = tmp_path / "a b.html"
    ip.run_cell_magic("kvscope", f"-o 'tq' --html \"{page}\"",
                      "llm.generate('the quick brown fox', SamplingParams(max_tokens=3))")
    assert page.exists() and "kvscope-pool" in page.read_text()
    assert isinstance(ip.user_ns["tq"], Trace)
    ip.user_ns["d"] = {"t": ip.user_ns["tq"]}  # a target in quotes only in part is an expression
    assert ip.run_line_magic("kvscope", "d['t']").trace is ip.user_ns["tq"]
    with pytest.raises(UsageError, match="No closing quotation"):
        ip.run_line_magic("kvscope", "llm --html 'x.html")


@pytest.mark.parametrize("line,says", [
    ("llm --html {tmp}/page.html -o kept", "--html exports a recorded Trace"),
    ("demo --html {tmp}/page.html", "--html exports a recorded Trace"),
    ("llm --html {tmp}/no/such/dir/page.html", "no directory"),
    ("llm --html ''", "--html '': not a file name"),
    ("llm --level summary --views timeline --html {tmp}/page.html", "--html exports the block views"),
    ("llm -o 'a b'", "-o/--out must be a variable name"),
    ("llm -o class", "-o/--out must be a variable name"),
    ("llm -o llm", "-o llm would replace the target llm"),
    ("llm --replay tcp://127.0.0.1:1", "--replay: only with 'attach'"),
    ("attach tcp://127.0.0.1:1 --views pool --max-steps 5", "--views, --max-steps: not with 'attach'"),
    ("llm --max-steps 0", "%kvscope: --max-steps must be an integer >= 1"),
    ("llm --interval -1", "%kvscope: --interval must be a finite number"),
    ("llm --max-load 2", "%kvscope: --max-load must be a share"),
    ("llm --views pool,bogus", "%kvscope: unknown views ['bogus']"),
    ("llm --level summary --views pool", "the only view it can feed is 'timeline'"),
])
def test_options_that_do_not_fit_are_refused_before_anything_is_built(ip, tmp_path, line, says):
    """Refused with a usage error before a dashboard attaches: no hook or block sink left on the
    engine, no variable set (a line-mode --html exported the empty recording, failed, and left
    the dashboard recording with no handle to detach it; -o took any string as a name)."""
    llm = ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    before = set(ip.user_ns)
    with pytest.raises(UsageError, match=re.escape(says)):
        ip.run_line_magic("kvscope", line.format(tmp=tmp_path))
    assert not llm.hooks.block_sinks and not any(llm.hooks.active(name) for name in HOOK_POINTS)
    assert set(ip.user_ns) == before and not list(tmp_path.iterdir())


def test_a_summary_recording_shows_the_timeline_unless_views_are_named(ip):
    """A ``summary`` recording has no blocks: without ``--views`` it shows the one view it can
    feed, live or replayed (it was refused for the default views, which it cannot feed)."""
    llm = ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    with llm.record("summary") as trace:
        llm.generate("the quick brown fox", SamplingParams(max_tokens=3), use_tqdm=False)
    ip.user_ns["tr"] = trace
    assert set(ip.run_line_magic("kvscope", "tr").views) == {"timeline"}
    live = ip.run_line_magic("kvscope", "llm --level summary")
    live.detach()
    assert set(live.views) == {"timeline"} and live.trace.level == "summary"
    assert list(ip.run_line_magic("kvscope", "tr --views timeline").views) == ["timeline"]


@pytest.mark.parametrize("options", ["--level full", "--max-steps 5", "--interval 0.5", "--level summary --max-load 0.5"])
def test_options_of_a_live_dashboard_are_refused_for_a_trace(ip, options):
    """A Trace replays what it recorded: the recording level, ring buffer and update pacing it
    took in silence are refused by name; its views still apply."""
    llm = make_llm(num_kv_blocks=16, block_size=8)
    with llm.record("blocks") as trace:
        llm.generate("the quick brown fox", SamplingParams(max_tokens=3), use_tqdm=False)
    ip.user_ns["tr"] = trace
    flags = ", ".join(o for o in options.split() if o.startswith("--"))
    with pytest.raises(UsageError, match=f"{re.escape(flags)}: only with a live dashboard"):
        ip.run_line_magic("kvscope", f"tr {options}")
    assert set(ip.run_line_magic("kvscope", "tr --views pool").views) == {"pool"}


def test_a_cell_whose_export_cannot_be_made_is_refused_before_it_runs(ip, tmp_path):
    """``%%kvscope --level summary --html page``: the export needs the block views, so the
    magic refuses it before the cell runs (the cell ran, then the export failed)."""
    llm = ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    with pytest.raises(UsageError, match="--html exports the block views"):
        ip.run_cell_magic("kvscope", f"--level summary --views timeline --html {tmp_path}/page.html -o ts",
                          "ran = llm.generate('the quick', SamplingParams(max_tokens=2))")
    assert "ran" not in ip.user_ns and "ts" not in ip.user_ns and not list(tmp_path.iterdir())
    assert llm.llm_engine.scheduler.step_count == 0


@pytest.mark.parametrize("cell", ["x = 1", "raise ValueError('the cell failed')", "raise KeyboardInterrupt"])
def test_a_cell_that_ran_no_step_says_its_page_has_nothing_to_show(ip, tmp_path, cell):
    """``%%kvscope --html page`` around a cell that ran no engine step (it failed or was
    interrupted first, or does not generate): the export raised a ValueError whose traceback ran
    through the magic, after the cell's own. It is one usage error line; the empty trace is
    still stored, as the recording it is, and no page is written."""
    llm = ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    ip.user_ns.pop("ts", None)
    page = tmp_path / "page.html"
    with pytest.raises(UsageError) as refused:
        ip.run_cell_magic("kvscope", f"llm --html {page} -o ts", cell)
    assert type(refused.value) is UsageError and "--html: the cell ran no engine step" in str(refused.value)
    assert not page.exists() and ip.user_ns["ts"].step_ids == [] and llm.llm_engine.scheduler.step_count == 0
    assert not llm.llm_engine.hooks.active("step.end")


@pytest.mark.parametrize("level,steps,says", [
    ("blocks", 0, "--html: the trace holds no engine step"),
    ("summary", 3, "--html exports the block views, and this trace was recorded at level 'summary'"),
])
def test_a_trace_the_page_cannot_show_is_refused_for_html_by_a_usage_error(ip, tmp_path, level, steps, says):
    """``%kvscope t --html page`` of a trace with no step, or of a ``summary`` one (``--level``
    is checked for what the magic records, not for a Trace it is given): the export's ValueError
    came as a traceback through the magic, after a replay was built. A usage error before that;
    no page is written."""
    llm = make_llm(num_kv_blocks=16, block_size=8)
    with llm.record(level) as trace:
        if steps:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=steps, temperature=0), use_tqdm=False)
    ip.user_ns["tr"] = trace
    page = tmp_path / "page.html"
    with pytest.raises(UsageError) as refused:
        ip.run_line_magic("kvscope", f"tr --html {page}")
    assert type(refused.value) is UsageError and says in str(refused.value)
    assert len(trace.step_ids) == steps and not page.exists()


@pytest.mark.parametrize("line,says", [
    ("--html {tmp}", "--html '{tmp}': not a file name"),
    ("tr", "'tr' is a Trace; cell mode records an LLM"),
])
def test_a_cell_whose_options_cannot_work_is_refused_before_it_runs(ip, tmp_path, line, says):
    """``%%kvscope --html <a directory>`` ran the cell, then failed writing the page;
    ``%%kvscope <a Trace>`` ran the cell beside a replay of the Trace, recording nothing. Both
    are refused by name before the cell runs."""
    llm = ip.user_ns["llm"] = make_llm(num_kv_blocks=16, block_size=8)
    with llm.record("blocks") as trace:
        llm.generate("the quick", SamplingParams(max_tokens=2), use_tqdm=False)
    ip.user_ns["tr"] = trace
    ip.user_ns.pop("ran", None)
    steps = llm.llm_engine.scheduler.step_count
    with pytest.raises(UsageError, match=re.escape(says.format(tmp=tmp_path))):
        ip.run_cell_magic("kvscope", line.format(tmp=tmp_path),
                          "ran = llm.generate('the quick', SamplingParams(max_tokens=2))")
    assert "ran" not in ip.user_ns and llm.llm_engine.scheduler.step_count == steps


def test_attach_magic_shows_the_attach_dashboard(ip):
    """``%kvscope attach <endpoint> --replay <endpoint> -o src`` subscribes and shows the attach views."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from attach_helpers import publisher, wait_for

    from kvscope.attach.wire import stored
    from kvscope.widgets import AttachDashboard

    with publisher() as pub:
        dash = ip.run_line_magic("kvscope", f"attach {pub.endpoint} --replay {pub.replay_endpoint} -o src")
        src = ip.user_ns["src"]
        try:
            assert isinstance(dash, AttachDashboard) and dash.attached is src
            # (no --interval: the attach dashboard's own default, as kvscope.dashboard(src) has it)
            assert dash.interval == inspect.signature(AttachDashboard).parameters["interval"].default
            wait_for(lambda: pub.publish([stored([9], None, [1], 1)]) >= 0 and src.block_hashes(src.instances[0]) == {9})
        finally:
            dash.detach()
            src.close()
        dash = ip.run_line_magic("kvscope", f"attach {pub.endpoint} --interval 0.7 -o src")
        dash.detach()
        ip.user_ns["src"].close()
        assert dash.interval == 0.7
    with pytest.raises(UsageError, match="usage: %kvscope attach"):
        ip.run_line_magic("kvscope", "attach")


@pytest.mark.parametrize("line,says", [
    ("attach {endpoint} --interval -1 -o src", "%kvscope: --interval must be a finite number of seconds >= 0"),
    ("attach {endpoint} --interval 1e10 -o src", "%kvscope: --interval must be a finite number of seconds >= 0"),
    ("attach nowhere -o src", "%kvscope: endpoints['nowhere'] must start with one of tcp://"),
    ("attach {endpoint} --replay {endpoint},{endpoint} -o src", "%kvscope: --replay has 2 entries for 1 endpoints"),
])
def test_a_refused_attach_line_is_a_usage_error_and_leaves_no_subscription(ip, line, says):
    """A refused option subscribed first and was refused by the dashboard after: the
    subscription went on receiving in its thread, with no handle to close it (``-o`` was not
    set yet) and a second one to come once the line was fixed; and each refusal was a
    ValueError's traceback, not the magic's one-line usage error."""
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from attach_helpers import publisher

    ip.user_ns.pop("src", None)
    with publisher() as pub:
        threads = set(threading.enumerate())
        with pytest.raises(UsageError) as refused:
            ip.run_line_magic("kvscope", line.format(endpoint=pub.endpoint))
        assert type(refused.value) is UsageError and str(refused.value).startswith(says)
        assert set(threading.enumerate()) <= threads and "src" not in ip.user_ns


def test_demo_command_refuses_max_tokens_past_the_model_length_with_a_usage_error(capsys):
    """``python -m kvscope demo --max-tokens N`` past what max_model_len leaves the longest demo
    prompt exits with status 2 and one line naming the limit (a traceback from generate before);
    the limit it names is the one the engine keeps: it takes that many tokens, and refuses one more."""
    from kvscope import LLM
    from kvscope.__main__ import DEMO_PROMPTS, main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", "cpu", "--max-tokens", "10000000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith("kvscope demo: error: --max-tokens must be at most ")
    limit = int(re.search(r"at most (\d+)", err[-1]).group(1))
    engine = LLM(device="cpu").llm_engine
    longest = max(DEMO_PROMPTS, key=lambda p: len(engine.tokenizer.encode(p, add_special_tokens=False)))
    engine.add_request(longest, SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request(longest, SamplingParams(max_tokens=limit + 1))


def test_demo_command_refuses_a_model_directory_whose_config_does_not_read_with_a_usage_error(tmp_path, capsys):
    """A --model directory whose config.json is not JSON: exit status 2 and one line naming the
    file (an OSError traceback, exit 1, before)."""
    from kvscope.__main__ import main

    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--device", "cpu", "--model", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert err[-1].startswith("kvscope demo: error: ") and str(tmp_path / "config.json") in err[-1]
