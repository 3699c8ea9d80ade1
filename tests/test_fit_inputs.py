"""memlab.fit's input: every malformed config field, plan option and GPU name fails in one line naming what is
wrong and what is allowed, before transformers is imported; the measured-step cache lives in the user's cache
folder unless MEMLAB_FIT_CACHE says otherwise."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
GPT2 = dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512)

# (config fields changed, the words the one line must hold)
BAD_CONFIGS = [
    (dict(hidden_size="64"), "'hidden_size' must be a positive int"),
    (dict(hidden_size=-64), "'hidden_size' must be a positive int"),
    (dict(hidden_size=64.0), "'hidden_size' must be a positive int"),
    (dict(num_attention_heads=5), "'hidden_size' (64) must be a multiple of 'num_attention_heads' (5)"),
    (dict(num_key_value_heads=3), "'num_attention_heads' (4) must be a multiple of 'num_key_value_heads' (3)"),
    (dict(num_hidden_layers=0), "'num_hidden_layers' must be a positive int"),
    (dict(num_hidden_layers=True), "'num_hidden_layers' must be a positive int"),
    (dict(vocab_size=None), "'vocab_size' must be a positive int"),
    (dict(intermediate_size=[176]), "'intermediate_size' must be a positive int or null"),
    (dict(rms_norm_eps=-1e-6), "'rms_norm_eps' must be a positive number"),
    (dict(attention_dropout=1.5), "'attention_dropout' must be a probability"),
    (dict(tie_word_embeddings="no"), "'tie_word_embeddings' must be true or false"),
    (dict(layer_types=["full_attention"]), "'layer_types' has 1 entries for 2 layers"),
    (dict(layer_types="sliding"), "'layer_types' must be a list of str"),
    (dict(num_local_experts=2, num_experts_per_tok=4), "'num_experts_per_tok' (4) must be at most"),
    (dict(model_type=7), "model_type must be a str"),
]


def _one_process(calls: list) -> list:
    """Run memlab.fit on each (config, kwargs) in a fresh process; returns [(error line or None, transformers
    imported before the error?)]."""
    code = ("import json, sys, memlab\nout = []\n"
            "for cfg, kw in json.loads(sys.argv[1]):\n"
            "    try:\n        memlab.fit(cfg, **kw); out.append([None, 'transformers' in sys.modules])\n"
            "    except (ValueError, TypeError) as e:\n        out.append([f'{type(e).__name__}: {e}', "
            "'transformers' in sys.modules])\n"
            "print(json.dumps(out))")
    env = dict(os.environ, PYTHONPATH=ROOT, MEMLAB_FIT_CACHE="")
    got = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def test_bad_config_fields_fail_in_one_line_before_transformers_is_imported():
    calls = [[dict(LLAMA, **change), {"gpu": 1, "seq": 32}] for change, _ in BAD_CONFIGS]
    calls += [[dict(GPT2, n_head=5), {"gpu": 1}], [dict(GPT2, n_embd="big"), {"gpu": 1}]]
    calls += [[LLAMA, {"gpu": "4090x"}], [LLAMA, {"gpu": 5000}], [LLAMA, {"gpu": 1, "seq": -4}],
              [LLAMA, {"gpu": 1, "batch": "2"}], [LLAMA, {"gpu": 1, "optimizer": "lion"}],
              [LLAMA, {"gpu": 1, "seq": 1024}]]
    words = [w for _, w in BAD_CONFIGS] + ["'n_embd' (64) must be a multiple of 'n_head' (5)",
                                           "'n_embd' must be a positive int", "gpu '4090x' is no known card",
                                           "capacity in GiB", "seq must be a positive int",
                                           "batch must be a positive int", "optimizer must be one of",
                                           "seq (1024) exceeds the model's max_position_embeddings (512)"]
    for (line, imported), want in zip(_one_process(calls), words):
        assert line is not None and want in line, (want, line)
        assert "\n" not in line and len(line) < 400, line
        assert not imported, f"transformers was imported before this error: {line}"


def test_the_cache_is_in_the_users_cache_folder_unless_memlab_fit_cache_says_otherwise(tmp_path, monkeypatch):
    from memlab.fitting.run import cache_folder
    monkeypatch.delenv("MEMLAB_FIT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder() == tmp_path / "xdg" / "memlab" / "fit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_folder() == tmp_path / "home" / ".cache" / "memlab" / "fit"
    monkeypatch.setenv("MEMLAB_FIT_CACHE", str(tmp_path / "mine"))
    assert cache_folder() == tmp_path / "mine"
    monkeypatch.setenv("MEMLAB_FIT_CACHE", "")
    assert cache_folder() is None


def test_a_cached_answer_needs_no_transformers(tmp_path, monkeypatch):
    """A run measured once (here in this process) is read back from the cache folder by a later process without
    importing transformers (what makes a repeated memlab-fit answer in about a second)."""
    import memlab
    from memlab.fitting import run
    monkeypatch.setenv("MEMLAB_FIT_CACHE", str(tmp_path))
    run.clear_cache()
    try:
        first = memlab.fit(LLAMA, 1, seq=32)
    finally:
        run.clear_cache()
    code = ("import sys, memlab\nr = memlab.fit(" + repr(LLAMA) + ", 1, seq=32)\n"
            "print(r.peak, 'transformers' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=ROOT, MEMLAB_FIT_CACHE=str(tmp_path))
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    peak, imported = again.stdout.split()
    assert int(peak) == first.peak and imported == "False"


@pytest.mark.parametrize("typed", ["4090", "RTX3090", "t4-16gb", "h100-80gb"])
def test_cards_by_the_names_people_type(typed):
    import memlab
    from memlab.core.gpus import resolve_gpu
    r = memlab.fit(LLAMA, typed, seq=32)
    spec = resolve_gpu(typed)
    assert r.gpu == spec.name and r.capacity == spec.capacity
    assert r.plan["precision"] == ("bf16" if spec.bf16 else "fp16")
