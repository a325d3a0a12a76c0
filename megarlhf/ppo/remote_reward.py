"""Rewards from a service the team already runs (`reward_url`): a step's samples go out as
JSON in POST requests of `reward_url_batch_size` samples, `reward_url_concurrency` at a time,
and come back as one score per sample.

Formats (`reward_url_format`):
- `native`: the request holds lists, one entry per sample: `prompts`, `responses`,
  `ground_truths`, `data_sources`, `prompt_ids`, `response_ids` and every other dataset column
  by its name (texts are null without a tokenizer; a column named like one of these is left
  out); the reply is `{"scores": [...]}`, and any other key holding a number (or null) per
  sample is logged as reward/<key> (their mean); other keys are ignored.
- `openrlhf`: OpenRLHF's remote reward model (`--remote_rm_url`): `query` (prompt and response
  texts joined), `prompts` and `labels` (the ground truths) in; `rewards` out.

Failures: a request that times out (`reward_timeout` seconds), cannot connect or loses its
connection, or gets a 429 or 5xx answer is retried `reward_url_retries` times with doubling
waits; a batch that still fails gives its samples no score (a failure, never a number: the
loop masks them, max_failed_reward_fraction bounds their share and names the URL and the last
error) and is counted (reward/url_failed_samples). Any other answer (a 4xx, a reply that is not JSON or lacks its scores) is a
mistake no retry mends: it stops the run at once, as does a redirect (urllib would resend the
POST as a GET, headers included, to wherever it points). Headers (`reward_url_headers_env`)
come from an environment variable holding a JSON object, and are never logged.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import torch

from megarlhf.ppo.rewards import RewardFnError, Scores, check_metric, check_score
from megarlhf.rewards.calls import Sample, batch_fields

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
FIRST_WAIT_S = 0.5
"""The wait before the first retry; each next one doubles."""


class _Transient(Exception):
    """A failure a retry may mend (timeout, no or a lost connection, 429 / 5xx)."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise RewardFnError(f"reward_url {req.full_url} answered HTTP {code}, a redirect to "
                            f"{newurl}: set reward_url to where the service answers")


_OPENER = urllib.request.build_opener(_NoRedirects)


def url_problem(url: str) -> str | None:
    """Why `url` is not an HTTP endpoint, or None (checked when the config is built)."""
    parts = urllib.parse.urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"reward_url={url!r} is not an http:// or https:// URL with a host"
    return None


def read_headers(variable: str | None) -> dict[str, str]:
    """The headers environment variable `variable` holds (a JSON object of strings); its
    value never appears in an error."""
    if variable is None:
        return {}
    text = os.environ.get(variable)
    if text is None:
        raise ValueError(f"reward_url_headers_env: environment variable {variable} is not set")
    try:
        headers = json.loads(text)
    except json.JSONDecodeError:
        headers = None
    if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise ValueError(f"reward_url_headers_env: {variable} must hold a JSON object of "
                         f'strings, e.g. {{"Authorization": "Bearer ..."}}')
    for name, value in headers.items():  # what http.client would refuse in a request
        if not _header_text(name) or ":" in name or " " in name or not _header_text(value):
            raise ValueError(f"reward_url_headers_env: {variable}'s header {name!r} is not "
                             f"a valid HTTP header (a line break, a non-Latin-1 character, "
                             f"or a name with ':' or a space)")
    return headers


def _header_text(text: str) -> bool:
    return "\n" not in text and "\r" not in text and all(ord(c) < 256 for c in text)


def check_reachable(url: str, timeout: float = 5.0) -> None:
    """Refuse a run whose reward server does not accept connections (before any rank starts:
    a missing server would otherwise show only after the first rollout)."""
    parts = urllib.parse.urlparse(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise ValueError(f"reward_url {url}: cannot connect to {parts.hostname}:{port} "
                         f"({e.__class__.__name__}: {e}); start the reward server first, or "
                         f"fix the URL") from None


class RemoteReward:
    def __init__(self, url: str, *, fmt: str, batch_size: int, concurrency: int,
                 timeout: float, retries: int, headers: dict[str, str],
                 allow_non_finite: bool):
        self.url, self.fmt, self.batch_size = url, fmt, batch_size
        self.timeout, self.retries, self.headers = timeout, retries, headers
        self.allow_non_finite = allow_non_finite
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency,
                                                           thread_name_prefix="reward_url")
        self._closed = threading.Event()  # in-flight requests make no further attempts

    @property
    def needs_text(self) -> bool:
        """OpenRLHF's format sends texts only; the native one sends token ids too."""
        return self.fmt == "openrlhf"

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def score(self, step: int, samples: list[Sample]) -> Scores:
        """[B] scores of `samples`, why those of failed batches have none, and the step's
        metrics."""
        start = time.monotonic()
        batches = [list(range(i, min(i + self.batch_size, len(samples))))
                   for i in range(0, len(samples), self.batch_size)]
        futures = [self._pool.submit(self._post, self._body([samples[i] for i in b]))
                   for b in batches]
        scores, failed, extras = [0.0] * len(samples), [None] * len(samples), {}
        retried = 0
        for batch, future in zip(batches, futures):
            reply, tries, error = future.result()
            retried += tries
            if error is not None:
                for i in batch:
                    failed[i] = f"reward_url {self.url} failed after {self.retries} " \
                                f"retries: {error}"
                continue
            where = f"reward_url {self.url} at step {step}, samples {batch[0]}-{batch[-1]}"
            values, metrics = self._read(reply, len(batch), where)
            for i, value in zip(batch, values):
                scores[i] = check_score(value, f"reward_url {self.url} at step {step}, "
                                               f"sample {i}", self.allow_non_finite)
            for name, per_sample in metrics.items():
                extras.setdefault(name, []).extend(v for v in per_sample if v is not None)
        metrics = {"reward/url_failed_samples": float(sum(f is not None for f in failed)),
                   "reward/url_retries": float(retried),
                   "reward/url_seconds": time.monotonic() - start}
        metrics.update({f"reward/{k}": sum(v) / len(v) for k, v in extras.items() if v})
        return Scores(torch.tensor(scores, dtype=torch.float32), metrics, failed)

    def _body(self, samples: list[Sample]) -> dict:
        if self.fmt == "openrlhf":
            return {"query": [s.prompt + s.response for s in samples],
                    "prompts": [s.prompt for s in samples],
                    "labels": [s.ground_truth for s in samples]}
        return batch_fields(samples)  # as a batched reward function gets them

    def _post(self, body: dict) -> tuple[object, int, str | None]:
        """(reply, retries taken, None) or (None, retries taken, the last error) once every
        retry failed. A mistake no retry mends raises RewardFnError."""
        data = json.dumps(body, default=str).encode()
        error = None
        for attempt in range(self.retries + 1):
            if attempt:
                if self._closed.wait(FIRST_WAIT_S * 2 ** (attempt - 1)):
                    return None, attempt - 1, "the run stopped"
            try:
                return self._request(data), attempt, None
            except _Transient as e:
                error = str(e)
        return None, self.retries, error

    def _request(self, data: bytes) -> object:
        request = urllib.request.Request(
            self.url, data=data, method="POST",
            headers={"Content-Type": "application/json", **self.headers})
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as e:
            detail = f"HTTP {e.code} {e.reason}"
            if e.code in RETRY_STATUSES:
                raise _Transient(detail) from None
            body = e.read()[:200].decode(errors="replace")
            raise RewardFnError(f"reward_url {self.url} answered {detail}: {body!r}; fix the "
                                f"request format (reward_url_format={self.fmt}) or the "
                                f"server") from None
        except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, lost links
            reason = getattr(e, "reason", e)
            raise _Transient(f"{reason.__class__.__name__}: {reason}") from None
        try:
            return json.loads(text)
        except ValueError:  # not JSON, or not UTF-8
            raise RewardFnError(f"reward_url {self.url} answered with something that is not "
                                f"JSON: {text[:200]!r}") from None

    def _read(self, reply, count: int, where: str) -> tuple[list, dict[str, list]]:
        """(scores, {metric: per-sample values}) out of one reply."""
        key = "rewards" if self.fmt == "openrlhf" else "scores"
        if not isinstance(reply, dict) or key not in reply:
            got = sorted(reply)[:6] if isinstance(reply, dict) else type(reply).__name__
            raise RewardFnError(f"{where}: the reply has no {key!r} ({got}); the "
                                f"{self.fmt} format answers {{{key!r}: [one per sample]}}")
        values = reply[key]
        if not isinstance(values, list) or len(values) != count:
            got = f"{len(values)} values" if isinstance(values, list) else repr(values)[:60]
            raise RewardFnError(f"{where}: {key!r} holds {got} for {count} samples")
        extras = {}
        if self.fmt == "native":
            for name, per_sample in reply.items():
                if name != key and isinstance(per_sample, list) and len(per_sample) == count \
                        and all(v is None or isinstance(v, (int, float)) for v in per_sample):
                    extras[name] = [check_metric(v, name, where) for v in per_sample]
        return values, extras
