"""`make demo`'s pipeline end to end: tokenizer, SFT, reward model and PPO on 4 ranks."""

from __future__ import annotations

import os

import pytest

from megarlhf import demo


@pytest.mark.slow
def test_demo_aligns_the_sft_model_with_the_learned_preference(tmp_path):
    out = demo.main(str(tmp_path / "demo"))
    assert out["rm_eval_accuracy"] > 0.9  # the preference is learnable (chance: 0.5)
    # The reward model's score of PPO's rollouts rises by well over its step-to-step noise
    # (about +-1 here), and more held-out answers use the preferred words than after SFT.
    assert out["reward_last"] > out["reward_first"] + 1.0, out
    assert out["warm_ppo"] >= out["warm_sft"] + out["answers"] // 4, out
    assert os.path.getsize(out["plot"]) > 10_000


def test_demo_refuses_to_replace_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a demo output"):
        demo.main(str(tmp_path))
    assert (tmp_path / "precious.txt").read_text() == "keep me"
