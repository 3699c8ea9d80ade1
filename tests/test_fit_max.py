"""memlab.fit_max and memlab-fit --max-seq / --max-batch: the largest sequence or batch for which memlab.fit says a
plan fits, found in a few measured steps; the answer fits and one more token (or sequence) does not."""

import pytest

import memlab

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
EXACT = dict(headroom=0.0, context=0)          # the card is all the step's: the limit moves with the bytes alone


def test_the_longest_sequence_fits_and_one_more_token_does_not():
    gpu = 6 / 1024                               # 6 MiB: the tiny Llama's limit lies in its 4096 positions
    m = memlab.fit_max(TINY, gpu, **EXACT)
    assert 512 < m.value < 4096, m
    assert m.at.fits and m.at.plan["seq"] == m.value
    assert not m.above.fits and m.above.plan["seq"] == m.value + 1
    assert m.at.needed <= m.at.usable < m.above.needed
    assert len(m.probes) <= 16, m.probes         # a bracketing search, not a scan (log2 of 4096 is 12)
    text = str(m)
    assert f"largest seq that fits: {m.value:,} tokens" in text and f"seq {m.value + 1:,} would need" in text
    again = memlab.fit(TINY, gpu, seq=m.value, **EXACT)           # the same answer as fit itself
    assert again.fits and again.needed == m.at.needed


def test_the_largest_batch_and_the_models_own_limit():
    b = memlab.fit_max(TINY, 6 / 1024, what="batch", seq=256, **EXACT)
    assert b.value >= 1 and b.at.fits and not b.above.fits and b.above.plan["batch"] == b.value + 1
    roomy = memlab.fit_max(TINY, 1, **EXACT)                      # 1 GiB: every position fits
    assert roomy.value == 4096 and roomy.above is None and "max_position_embeddings" in str(roomy)
    none = memlab.fit_max(TINY, 0.0001, **EXACT)                   # 100 KiB: not even one token
    assert none.value == 0 and none.at is None and "not even seq 1 fits" in str(none)


def test_bad_requests_say_what_is_allowed():
    for kw, word in ((dict(what="both"), "what must be 'seq' or 'batch'"),
                     (dict(what="seq", seq=64), "do not pass seq="),
                     (dict(what="batch", micro_batch=1), "micro_batch must be None"),
                     (dict(ceiling=0), "ceiling must be a positive int")):
        with pytest.raises(ValueError, match=word) as e:
            memlab.fit_max(TINY, 1, **kw)
        assert "\n" not in str(e.value)


def test_the_command_line_prints_the_limit(tmp_path):
    import contextlib
    import io
    import json
    from memlab.fitting.search import main
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main([str(config), "--gpu", "1", "--max-batch", "--seq", "512", "--headroom", "0", "--no-search"])
    assert code == 0 and "largest batch that fits:" in buf.getvalue() and "would need" in buf.getvalue()


def test_the_command_line_takes_the_context_measured_on_the_card(tmp_path):
    """--context MIB replaces the cited CUDA context with the one measured on the user's card, for fit and fit_max."""
    import contextlib
    import io
    from memlab.fitting.search import main
    outs = []
    for extra in ([], ["--context", "1341"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["memlab/fitting/configs/gpt2.json", "--gpu", "4", "--seq", "64", "--no-search", *extra]) == 0
        outs.append(buf.getvalue())
    assert "(given)" in outs[1] and "1.31 GiB" in outs[1] and "(given)" not in outs[0]
    assert main(["gpt2", "--context", "-1", "--no-search"]) == 2
