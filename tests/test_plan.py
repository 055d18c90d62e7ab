"""Plan files: good ones load and expand; bad ones give one clear line naming file and field, exit 2."""

import subprocess
from pathlib import Path

import pytest

from spectune.errors import SpectuneError
from spectune.plan import load_plan, plan_from_dict, plan_to_dict

REPO = Path(__file__).resolve().parent.parent


def test_shipped_plans_load_and_expand_step_lists():
    plan = load_plan(REPO / "configs" / "embedded.toml")
    names = [s.name for s in plan.servers]
    assert names[0] == "target" and not plan.servers[0].is_speculative
    assert "eagle-g2" in names and "eagle-g4" in names and "draft-g2" in names
    # three step counts of the method SGLang tunes: the tuned ladder's steps measured, one held out inside the range
    assert {s.num_speculative_tokens for s in plan.servers if s.name.startswith("eagle")} == {2, 3, 4}
    # the parallel drafter beside the EAGLE head, at the same step counts
    steps = {m: {s.num_speculative_tokens for s in plan.servers if s.method == m} for m in ("eagle", "dflash")}
    assert steps["dflash"] == steps["eagle"] == {2, 3, 4}
    assert plan.interleave  # a slow stretch of the host falls on every server alike, not on one server's cells
    load_plan(REPO / "configs" / "vllm-cpu.toml")
    parallel = load_plan(REPO / "configs" / "parallel-drafting.toml")
    assert {(s.method, s.num_speculative_tokens) for s in parallel.servers if s.is_speculative} == {
        (m, k) for m in ("eagle", "dflash") for k in range(1, 9)}


def test_plan_digest_changes_with_any_field():
    base = {"servers": [{"name": "t"}], "batch_sizes": [1, 2]}
    assert plan_from_dict(base).digest() == plan_from_dict(dict(base)).digest()
    assert plan_from_dict(base).digest() != plan_from_dict({**base, "max_tokens": 65}).digest()


def test_recorded_plan_round_trips_through_the_manifest():
    from spectune.plan import plan_to_dict

    plan = load_plan(REPO / "configs" / "embedded.toml")
    again = plan_from_dict(plan_to_dict(plan))
    assert again == plan and again.digest() == plan.digest()


BAD_PLANS = [
    ('servers = [{name = "t"}]\nbatchsizes = [1]\n', "unknown key(s) ['batchsizes']"),
    ('[[servers]]\nname = "t"\nengine = "tgi"\n', "servers[0].engine = 'tgi': unknown engine"),
    ('[[servers]]\nname = "t"\n[[servers]]\nname = "n"\nmethod = "ngram"\nnum_speculative_tokens = 3\n', "prompt_lookup_min and prompt_lookup_max"),
    ('[[servers]]\nname = "t"\n[[servers]]\nname = "d"\nmethod = "draft_model"\n', "needs num_speculative_tokens"),
    ('[[servers]]\nname = "t"\n[[servers]]\nname = "d"\nmethod = "medusa9"\nnum_speculative_tokens = 2\n', "unknown method"),
    ('batch_sizes = [4, 1]\n[[servers]]\nname = "t"\n', "ascending"),
    ('batch_sizes = [0]\n[[servers]]\nname = "t"\n', "integers >= 1"),
    ('repeats = "two"\n[[servers]]\nname = "t"\n', "repeats = 'two'"),
    ('[[servers]]\nname = "d"\nmethod = "draft_model"\nnum_speculative_tokens = 2\n', "no target-only server"),
    ('[[servers]]\nname = "t"\n[[servers]]\nname = "t"\n', "unique"),
    ('[[servers]]\nname = "t"\nnum_speculative_tokens = 3\n', "without `method`"),
    ('[[servers]\nname = "t"\n', "not valid TOML"),
    ('schedule = "poisson"\n[[servers]]\nname = "t"\n', "needs request_rates"),
    ('request_rates = [1.0]\n[[servers]]\nname = "t"\n', "request_rates apply to schedule = \"poisson\""),
    ('schedule = "poisson"\nrequest_rates = [0]\n[[servers]]\nname = "t"\n', "request_rates = [0]: must be a list of numbers > 0"),
    ('schedule = "poisson"\nrequest_rates = [2, 1]\n[[servers]]\nname = "t"\n', "ascending"),
    ('schedule = "open"\n[[servers]]\nname = "t"\n', "\"poisson\" (open loop at request_rates)"),
    ('burstiness = 0\n[[servers]]\nname = "t"\n', "burstiness = 0: must be a number > 0"),
    ('slo_ttft_ms = -5\n[[servers]]\nname = "t"\n', "slo_ttft_ms = -5: must be a number > 0"),
    ('interleave = "yes"\n[[servers]]\nname = "t"\n', "interleave = 'yes': must be true or false"),
    ('relaunch = 1\n[[servers]]\nname = "t"\n', "relaunch = 1: must be true or false"),
    ('relaunch = true\n[[servers]]\nname = "t"\nengine = "openai"\nurl = "http://127.0.0.1:9"\n',
     "relaunch = true, but server(s) ['t'] are attached by url"),
    ('[[servers]]\nname = "t"\ntokenizer = "/no/such/dir"\n', "server 't': tokenizer: cannot read a tokenizer at /no/such/dir"),
    ('[[servers]]\nname = "t"\nenv = {OMP_NUM_THREADS = 1}\n', "env = {'OMP_NUM_THREADS': 1}: must be a table of strings"),
]


@pytest.mark.parametrize("text,expected", BAD_PLANS)
def test_bad_plan_is_one_clear_error(tmp_path, text, expected):
    from spectune.sweep import _preflight

    path = tmp_path / "plan.toml"
    path.write_text(text)
    with pytest.raises(SpectuneError) as info:
        _preflight(load_plan(path))  # what the sweep checks before anything launches
    assert expected in str(info.value)
    assert str(path) in str(info.value) or "tokenizer" in expected


def test_server_env_is_a_table_or_pairs_and_reaches_the_launched_server(tmp_path):
    from spectune.servers import make_server

    path = tmp_path / "plan.toml"
    path.write_text('[[servers]]\nname = "a"\nengine = "vllm"\nmodel = "/m"\nenv = {VLLM_CPU_OMP_THREADS_BIND = "0", X = "1"}\n'
                    '[[servers]]\nname = "b"\nengine = "vllm"\nmodel = "/m"\nenv = [["X", "2"]]\n')
    a, b = load_plan(path).servers
    assert a.env == (("VLLM_CPU_OMP_THREADS_BIND", "0"), ("X", "1")) and b.env == (("X", "2"),)
    assert make_server(a, tmp_path).environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert load_plan(path).digest() == plan_from_dict(plan_to_dict(load_plan(path))).digest()  # survives the manifest


def test_open_loop_and_slo_keys_load_and_older_plans_keep_their_digest():
    from spectune.plan import plan_to_dict

    plan = plan_from_dict({"schedule": "poisson", "request_rates": [1, 2.5], "burstiness": 0.5, "slo_ttft_ms": 200,
                           "slo_tpot_ms": 20, "batch_sizes": [8], "servers": [{"name": "t"}]})
    assert plan.request_rates == (1.0, 2.5) and plan.burstiness == 0.5 and (plan.slo_ttft_ms, plan.slo_e2e_ms) == (200, None)
    assert plan_from_dict(plan_to_dict(plan)) == plan
    # keys added later are left out of the digest at their defaults: a run started before them still resumes
    closed = plan_from_dict({"servers": [{"name": "t"}]})
    assert not {"request_rates", "burstiness", "slo_ttft_ms", "slo_tpot_ms", "slo_e2e_ms"} & set(plan_to_dict(closed))
    assert "tokenizer" not in plan_to_dict(closed)["servers"][0]


def test_bad_plan_through_the_cli_exits_2_with_one_line(tmp_path, spectune_cmd):
    path = tmp_path / "plan.toml"
    path.write_text('[[servers]]\nname = "t"\nengine = "tgi"\n')
    out = tmp_path / "results"
    proc = subprocess.run([*spectune_cmd, "sweep", str(path), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "engine" in lines[0] and str(path) in lines[0]
    assert not out.exists()  # nothing launched, nothing half-written
