"""`bench.peers.host_profile`: py-spy's raw stacks summed per thread, leaf and repository function."""

from __future__ import annotations

from bench.peers.host_profile import main, read_raw, summarize, thread_name

RAW = """\
thread (0x7f01): decode:decode-pp53iug2;WorkerThread._run (deployments/worker_thread.py:196);Engine.step (workers/engine.py:250);Engine._launch (workers/engine.py:344) 7
thread (0x7f01): decode:decode-pp53iug2;WorkerThread._run (deployments/worker_thread.py:196);Engine.step (workers/engine.py:251);to_device (workers/host_copy.py:26) 5
thread (0x7f02): AsyncIO Thread: default;Thread.run (threading.py:1010) 11
thread (0x7f03): Thread-1 (_run_user_code_event_loop);DecodeServer.generate (deployments/decode_server.py:162);Series._call (deployments/metrics/series.py:69);Metric._record (ray/util/metrics.py:133) 3
not a stack line
"""


def test_threads_leaves_and_repository_functions():
    s = summarize(read_raw(RAW), top=3)
    assert s["samples"] == 26
    assert dict(s["threads"]) == {"decode:<replica>": 12, "AsyncIO Thread: default": 11,
                                  "Thread-1 (_run_user_code_event_loop)": 3}
    assert s["leaves"][0] == ("Thread.run (threading.py:1010)", 11)
    repo = dict(s["repository"])
    # One count per stack and function, whatever line of it the stack was on.
    assert repo["Engine.step (workers/engine.py)"] == 12
    assert repo["WorkerThread._run (deployments/worker_thread.py)"] == 12
    assert "Thread.run (threading.py)" not in repo


def test_thread_names():
    assert thread_name("thread (0x7f01): prefill:prefill-abc") == "prefill:<replica>"
    assert thread_name("thread (12345)") == "(unnamed)"
    assert thread_name("garbage") == "?"


def test_cli_prints_shares_and_writes_json(tmp_path, capsys):
    raw = tmp_path / "raw.txt"
    raw.write_text(RAW)
    main([str(raw), "--rate", "10", "--seconds", "2", "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert "26 active samples in 20 sampling slots" in out
    assert "60.0% of the run  decode:<replica>" in out
    assert (tmp_path / "out.json").exists()
