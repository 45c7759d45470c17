import json

from dlm.checkpoint import load_model
from dlm.sampling import SampleConfig, generate


def test_tiny_ar_trains_and_generates(tiny_ar):
    rows = [json.loads(x) for x in (tiny_ar / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 0.5
    model, ck = load_model(tiny_ar)
    res = generate(model, ck, "def main(", SampleConfig(max_new_tokens=16))
    assert res.stats.new_tokens == len(res.tokens[0]) > 0
