"""Rule-checked rewards: the built-in checkers on tricky answers, how user functions are called
(batched text, verl's compute_score, token ids), and the worker pool that calls them with a
timeout (a hung checker scores 0 and is counted; a run of them stops the run)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megarlhf.ppo.rewards import RewardFnError, RewardFunction
from megarlhf.rewards import exact_match_reward, format_reward, math_reward
from megarlhf.rewards.answers import final_answer
from megarlhf.rewards.calls import BATCH, IDS, SAMPLE, Sample, batch_kwargs, load, style_of


@pytest.mark.parametrize("response,truth,right", [
    ("So the total is \\boxed{42}.", "42", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),               # fraction vs decimal
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True),      # dfrac vs frac
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", True),             # nested braces, not a number
    ("First \\boxed{3}, no wait, \\boxed{4}", "4", True),  # the last box
    ("\\boxed{3} and then 4", "4", False),                 # a box beats a later number
    ("It costs $1,250.", "1250", True),                    # thousands separator, dollars
    ("The answer is 7.", "7", True),
    ("The answer is 42 apples.", "42", True),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", True),  # GSM8K style
    ("x = 5", "5", True),
    ("\u22123", "-3", True),                               # Unicode minus
    ("50%", "50", True),
    ("3.0", "3", True),
    ("0.3333", "1/3", False),                              # not within 1e-6
    ("I think 3, 4", "3", False),                          # the last number counts
    ("no idea", "3", False),
    ("\\boxed{12}", "#### 12", True),                       # a GSM8K solution as the truth
    ("\\boxed{12}", 12, True),                              # a numeric truth
    ("\\boxed{B}", ["A", "b"], True),                       # a list of accepted answers
    ("\\boxed{12}", None, False),                           # no truth: never right
])
def test_math_checker_on_tricky_answers(response, truth, right):
    result = math_reward([response], [truth])
    assert result["scores"] == [float(right)], final_answer(response)


def test_math_checker_reports_whether_an_answer_was_found():
    assert math_reward(["no idea", "7"], ["7", "7"])["answered"] == [0.0, 1.0]


@pytest.mark.parametrize("response,truth,right", [
    ("Paris", "paris", True),
    ("  Paris.\n", "Paris", True),
    ("\"Paris!\"", "Paris", True),
    ("New   York", "new york", True),
    ("Paris, France", "Paris", False),
    ("50%", "50", False),                                   # exact: the % matters
    ("Rome", ["Paris", "Rome"], True),
    ("Rome", None, False),
])
def test_exact_match(response, truth, right):
    assert exact_match_reward([response], [truth]) == [float(right)]


def test_format_reward_matches_across_lines():
    check = format_reward(r"<think>.+</think>\s*\\boxed\{.+\}", score=0.5)
    assert check(["<think>a\nb</think> \\boxed{1}", "\\boxed{1}"]) == [0.5, 0.0]


def test_the_calling_convention_is_told_from_the_signature():
    assert style_of("math", load("math")) == BATCH
    assert style_of("x", load("tests.reward_fns:verl_score")) == SAMPLE
    assert style_of("x", load("tests.reward_fns:first_id_reward")) == IDS
    with pytest.raises(ValueError, match="cannot tell how to call no_responses_asked"):
        style_of("x", load("tests.reward_fns:no_responses_asked"))
    with pytest.raises(ValueError, match="must be a built-in \\(math, exact_match\\) or"):
        load("maths")
    samples = [Sample("p", "r", [1], [2], "t", "a", {"level": 3, "id": 9})]
    named = batch_kwargs(load("tests.reward_fns:length_reward"), samples)
    assert named == {"prompts": ["p"], "responses": ["r"]}  # only what it names
    everything = batch_kwargs(load("tests.reward_fns:truth_reward"), samples)
    assert everything["level"] == [3] and everything["id"] == [9]  # columns as keywords
    assert everything["ground_truths"] == ["t"] and everything["response_ids"] == [[2]]


def _samples(truths, sources=None, metadata=None) -> list[Sample]:
    sources = sources or [None] * len(truths)
    return [Sample(prompt=f"q{i}", response=str(t), prompt_ids=[1], response_ids=[5 + i],
                   ground_truth=t, data_source=s, metadata=(metadata or {}))
            for i, (t, s) in enumerate(zip(truths, sources))]


@pytest.fixture
def make_reward():
    made = []

    def make(spec, by_source=None, **kw):
        made.append(RewardFunction(spec, by_source, allow_non_finite=False, **kw))
        return made[-1]

    yield make
    for reward in made:
        reward.close()


def test_batched_function_in_the_pool_gets_the_batch_and_reports_metrics(make_reward):
    reward = make_reward("tests.reward_fns:truth_reward", workers=2)
    samples = _samples(["x", None, "y", "z"], ["a", "a", "b", None], {"level": 1})
    scores, metrics, failed = reward.score(1, samples)
    assert scores.tolist() == [1.0, 0.0, 1.0, 1.0]  # split over 2 workers, back in order
    assert metrics == {"reward/timeouts": 0.0, "reward/worker_restarts": 0.0,
                       "reward/saw_level": 1.0, "reward/source_a": 0.5}


def test_data_source_routes_rows_to_their_function(make_reward):
    reward = make_reward("exact_match", {"m": "math", "v": "tests.reward_fns:verl_score",
                                         "ids": "tests.reward_fns:first_id_reward"})
    samples = _samples(["1/2", "0.5", "0.5", "x"], ["m", None, "v", "ids"])
    samples[0] = Sample("q", "\\boxed{0.5}", [1], [5], "1/2", "m")
    samples[3] = Sample("q", "x", [1], [7, 8], "x", "ids")
    scores, metrics, failed = reward.score(1, samples)
    # math: 0.5 == 1/2; exact_match: "0.5" == "0.5"; verl: equal -> 2.0; ids: first id 7
    assert scores.tolist() == [1.0, 1.0, 2.0, 7.0]
    assert metrics["reward/answered"] == 1.0 and metrics["reward/had_extra"] == 0.0


def test_a_hung_call_has_no_score_is_counted_and_the_next_call_runs(make_reward):
    reward = make_reward("tests.reward_fns:hanging_reward", workers=2, timeout=2.0)
    t = time.monotonic()
    scores, metrics, failed = reward.score(1, _samples(["hang", "ok"]))  # one call per worker
    assert time.monotonic() - t < 30  # not 600 s: the hung worker was killed
    assert failed == ["reward_fn tests.reward_fns:hanging_reward timed out "
                      "(reward_timeout=2.0s)", None]
    assert scores[1] == 1.0 and metrics["reward/timeouts"] == 1.0
    scores, metrics, failed = reward.score(2, _samples(["ok", "ok"]))  # a fresh worker took over
    assert scores.tolist() == [1.0, 1.0] and failed == [None, None]
    assert metrics["reward/timeouts"] == 0.0


def test_a_worker_killed_from_outside_gets_its_call_again(make_reward, tmp_path):
    reward = make_reward("tests.reward_fns:killed_once", workers=1)
    marker = str(tmp_path / "killed")
    scores, metrics, failed = reward.score(1, _samples([marker, marker]))
    assert scores.tolist() == [1.0, 1.0] and metrics["reward/worker_restarts"] == 1.0
    # Killed on every try: the call, not the machine, is the problem.
    reward = make_reward("tests.reward_fns:always_killed", workers=1)
    with pytest.raises(RewardFnError, match=r"its worker process died \(exit code -9\), "
                                            r"killed 3 times on this call"):
        reward.score(2, _samples(["a", "b"]))


@pytest.mark.parametrize("spec,names", [
    ("tests.reward_fns:dying_reward", "its worker process died (exit code 3)"),
    ("tests.reward_fns:short_reward", "returned 1 values for 2 samples"),
])
def test_a_broken_batched_function_stops_the_run_naming_it(make_reward, spec, names):
    reward = make_reward(spec, workers=1)
    with pytest.raises(RewardFnError, match=r"reward_fn .* at step 4, sample 0 \(of samples "
                                            r"0-1\)") as failure:
        reward.score(4, _samples(["a", "b"]))
    assert names in str(failure.value)


def test_the_installed_command_finds_a_reward_module_in_the_working_directory(tmp_path):
    # The `megarlhf` console script's sys.path holds its bin/ directory, not the user's; a
    # reward_fn module beside the recipe must load as it does with `python -m megarlhf.cli`.
    script = os.path.join(os.path.dirname(sys.executable), "megarlhf")
    (tmp_path / "my_rewards.py").write_text(
        "def score(responses, ground_truths):\n    return [1.0 for _ in responses]\n")
    (tmp_path / "actor").mkdir()  # no checkpoint: the check after loading the reward_fn stops
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "r.yaml").write_text("actor: actor\nprompts: p.jsonl\nout_dir: out\n"
                                     "reward_fn: my_rewards:score\nalgorithm: grpo\n"
                                     "samples_per_prompt: 2\n")
    done = subprocess.run([script, "ppo", "--dry-run", "--config", "r.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 2, done.stderr
    # Loaded and seen to read text: the next complaint is the missing tokenizer.
    assert "the reward function reads text, but no tokenizer is known" in done.stderr, done.stderr
