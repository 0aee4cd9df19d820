"""``LLM(kv_events_config=...)`` start-up: pandas is imported and the publisher's sockets are
bound before any weight loads, an endpoint ZMQ refuses is reported by its setting and address, and a start-up that
fails leaves nothing behind (no worker running, no port bound), so a retry can bind the same port.

Real engines on the tiny CPU checkpoints; ``kvscope.llm._make_executor`` is only wrapped, to see
whether (and what) it built.
"""
from __future__ import annotations

import errno
import re
import shutil
import subprocess
import sys
from typing import Any, Iterator

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("pandas")
zmq = pytest.importorskip("zmq")

import kvscope  # noqa: E402
import kvscope.llm as llm_module  # noqa: E402
from attach_helpers import applied, free_port, wait_for  # noqa: E402
from engine_helpers import greedy, make_llm  # noqa: E402
from kvscope.attach.publisher import KVEventPublisher  # noqa: E402
from tiny_models import tiny_checkpoint  # noqa: E402


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every executor ``LLM(...)`` builds from now on (the real one, only recorded)."""
    executors: list[Any] = []
    make = llm_module._make_executor

    def recorded(*args: Any) -> Any:
        executors.append(make(*args))
        return executors[-1]

    monkeypatch.setattr(llm_module, "_make_executor", recorded)
    return executors


@pytest.fixture
def occupied() -> Iterator[tuple[Any, int]]:
    """A PUB socket bound to a free port on every interface, and that port."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://*")
    try:
        yield sock, port
    finally:
        sock.close()
        ctx.term()


def publishing(**kv: Any) -> dict[str, Any]:
    return {"enable_kv_cache_events": True, "topic": "kv-events", **kv}


def test_an_endpoint_in_use_fails_before_the_weights_load_and_a_retry_publishes(built, occupied) -> None:
    sock, port = occupied
    endpoint, replay = f"tcp://*:{port}", f"tcp://*:{free_port()}"
    config = publishing(endpoint=endpoint, replay_endpoint=replay)
    with pytest.raises(ValueError) as info:
        make_llm(block_size=4, num_kv_blocks=24, kv_events_config=config)
    assert str(info.value) == f"kv_events_config.endpoint {endpoint!r} cannot be bound: Address already in use"
    assert isinstance(info.value.__cause__, zmq.ZMQError) and info.value.__cause__.errno == errno.EADDRINUSE
    assert built == []  # no weight read, no worker spawned

    sock.close()  # the port is free again: the same settings now build an engine that publishes on it
    with make_llm(block_size=4, num_kv_blocks=24, kv_events_config=config) as llm:
        att = kvscope.attach(f"tcp://127.0.0.1:{port}", topic="kv-events",
                             replay_endpoints=f"tcp://127.0.0.1:{replay.rpartition(':')[2]}", replay_timeout=1.0)
        try:
            llm.generate([list(range(5, 25))], greedy(4), use_tqdm=False)
            pub = llm.kv_events.publisher
            assert pub._seq > 0
            wait_for(applied(att, att.streams[0].name, pub._seq - 1), what="every batch")
            assert att.block_hashes(att.streams[0].name) == set(llm.llm_engine.block_manager.hash_to_block) != set()
        finally:
            att.close()


def test_a_replay_endpoint_not_on_this_host_is_named_and_the_endpoint_released(built) -> None:
    port = free_port()
    replay = "tcp://192.0.2.1:*"  # TEST-NET-1: on no interface of this host
    with pytest.raises(ValueError, match=rf"^kv_events_config\.replay_endpoint {re.escape(repr(replay))} cannot be "
                                         rf"bound: {re.escape(zmq.strerror(errno.EADDRNOTAVAIL))}$") as info:
        make_llm(kv_events_config=publishing(endpoint=f"tcp://*:{port}", replay_endpoint=replay))
    assert isinstance(info.value.__cause__, zmq.ZMQError)
    assert built == []
    KVEventPublisher(f"tcp://*:{port}").close()  # the PUB socket bound before it was unbound


def test_a_data_parallel_rank_names_the_port_it_moved_to(occupied) -> None:
    _, port = occupied
    endpoint = f"tcp://*:{port - 1}"
    with pytest.raises(ValueError, match=rf"^kv_events_config\.endpoint {re.escape(repr(endpoint))} "
                                         rf"\('tcp://\*:{port}' at this data_parallel_rank\) cannot be bound"):
        make_llm(kv_events_config=publishing(endpoint=endpoint), data_parallel_rank=1)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_start_up_that_fails_after_the_weights_loaded_shuts_down_and_unbinds(
        built, monkeypatch, tensor_parallel_size: int) -> None:
    """The KV events cannot attach (their recorder does not import, as without pandas) once the
    weights are loaded: the weights are released, tensor-parallel workers stopped, both ports
    unbound, and the import's error is what the caller sees."""
    endpoint, replay = f"tcp://*:{free_port()}", f"tcp://*:{free_port()}"
    monkeypatch.setitem(sys.modules, "kvscope.trace.recorder", None)
    with pytest.raises(ImportError, match="kvscope.trace.recorder"):
        make_llm(tensor_parallel_size=tensor_parallel_size, num_kv_blocks=16,
                 kv_events_config=publishing(endpoint=endpoint, replay_endpoint=replay))
    (executor,) = built
    if tensor_parallel_size == 1:
        assert executor.model is None and executor.kv_cache is None
    else:
        procs = executor._ranks.procs
        assert procs and executor._ranks.closed and not any(p.is_alive() for p in procs)
    KVEventPublisher(endpoint, replay).close()  # both ports free for a retry


def test_without_pandas_the_kv_events_are_refused_before_the_weights_load(tmp_path) -> None:
    """The KV events' recorder needs pandas (the attach extra). Without it, ``LLM(...)`` is
    refused at once, naming what to install, where it failed only once the weights had loaded.
    A checkpoint without its weights tells the two apart: reaching them fails otherwise."""
    weightless = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "weightless")
    for weights in weightless.glob("*.safetensors"):
        weights.unlink()
    config = publishing(endpoint=f"tcp://*:{free_port()}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):  # (pandas here: the weights are read)
        kvscope.LLM(str(weightless), device="cpu", dtype="float32", kv_events_config=config)
    script = f"""
import sys
sys.modules["pandas"] = None  # (import pandas raises ImportError)
import kvscope
try:
    kvscope.LLM({str(weightless)!r}, device="cpu", dtype="float32", kv_events_config={config!r})
except Exception as exc:
    print(type(exc).__name__, exc, sep=": ")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    refused = r'ImportError: kv_events_config needs pandas\b.*; install it with pip install "kvscope\[attach\]"\n'
    assert re.fullmatch(refused, run.stdout), run.stdout
