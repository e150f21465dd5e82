"""The open-loop request stream of bench_open_loop.py: arrival times, prompt and output lengths, adapters.

Everything is drawn from numpy generators seeded by ``seed`` (no data set is downloaded):

- Arrivals: a Poisson process of ``rate`` requests/s (exponential gaps of mean 1/rate, drawn as
  unit exponentials scaled by 1/rate, so every rate replays the same pattern, stretched);
  ``rate`` = inf sends every request at once. ``burstiness`` b != 1 draws gamma gaps of shape b
  and the same mean instead, as ``vllm bench serve --burstiness`` does: their coefficient of
  variation is 1/sqrt(b), so b < 1 sends requests in bursts with lulls between, b > 1 more evenly.
- Lengths: ShareGPT-like log-normals rounded and clipped to [4, max], located so that the clipped
  lengths keep the asked mean. ShareGPT, as vLLM and SGLang benchmark it, averages ~224 prompt
  and ~198 output tokens per request (e.g. 369,103 input and 326,408 output tokens over 1,648
  requests, sgl-project/sglang#2805) with long right tails; the defaults are means 224 and 198
  with log-sigmas 1.0 (prompts: median ~145) and 0.8 (outputs: median ~146), and caps 1024 /
  1024 (vLLM's ShareGPT filter keeps prompts under 1024 tokens). S-LoRA's synthetic workload
  draws both uniformly from [8, 512] instead (mean 260).
- Prompt token ids are uniform over [10, vocab) and differ in every run (``salt``), so no run
  finds another's prompts in the server's prefix cache.
- Adapters (``workload``): distinct = round robin over the N adapters (every request a different
  adapter while N >= the requests in flight); uniform = uniform over N; skewed = Zipf over N,
  P(k-th most popular) proportional to k^-alpha with alpha = 1.5 as PERF.md's Skewed (which
  adapters are the popular ones is a seeded permutation); base = no adapter.
- ``shared_prefix_len`` = L: every prompt starts with a system prompt of L tokens, one per adapter
  (the base model has its own), then its drawn length of fresh tokens.

The lengths and arrivals depend only on ``seed`` (and ``burstiness``), never on the workload: at one rate every
workload sends the same lengths at the same times and only the adapters differ (a paired
comparison against the base model).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

WORKLOADS = ("distinct", "uniform", "skewed", "base")
MIN_LEN = 4
FIRST_TOKEN_ID = 10  # leave the lowest ids (special tokens of small vocabularies) alone


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """E[clip(X, low, high)] for log X ~ N(mu, sigma^2)."""
    if sigma == 0:
        return min(max(math.exp(mu), low), high)
    a, b = math.log(low), math.log(high)
    inside = math.exp(mu + sigma ** 2 / 2) * (_normal_cdf((b - mu - sigma ** 2) / sigma)
                                              - _normal_cdf((a - mu - sigma ** 2) / sigma))
    return low * _normal_cdf((a - mu) / sigma) + high * (1 - _normal_cdf((b - mu) / sigma)) + inside


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A log-normal of log-standard deviation ``sigma`` clipped to [low, high], whose location is
    chosen so that the clipped lengths average ``mean`` (the clip does not lower the mean)."""

    mean: float
    sigma: float
    high: int
    low: int = MIN_LEN

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length bounds must satisfy 1 <= low <= high, got [{self.low}, {self.high}]")
        if self.sigma < 0 or not self.low <= self.mean <= self.high:
            raise ValueError(f"a length mean must lie in [{self.low}, {self.high}] and sigma be >= 0, got mean "
                             f"{self.mean:g}, sigma {self.sigma:g} (raise the max length or lower the mean)")

    @property
    def mu(self) -> float:
        """The log-normal's location (log of its median before the clip), found by bisection."""
        lo, hi = math.log(self.low) - 10 * self.sigma - 1, math.log(self.high) + 10 * self.sigma + 1
        for _ in range(100):  # the clipped mean rises with mu
            mid = (lo + hi) / 2
            below = clipped_lognormal_mean(mid, self.sigma, self.low, self.high) < self.mean
            lo, hi = (mid, hi) if below else (lo, mid)
        return (lo + hi) / 2

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(np.rint(rng.lognormal(self.mu, self.sigma, n)), self.low, self.high).astype(np.int64)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """One run's request stream (see the module docstring)."""

    workload: str
    adapters: tuple[str, ...]
    rate: float
    num_requests: int
    vocab_size: int
    prompt: LengthDist = field(default_factory=lambda: LengthDist(224, 1.0, 1024))
    output: LengthDist = field(default_factory=lambda: LengthDist(198, 0.8, 1024))
    shared_prefix_len: int = 0
    zipf_alpha: float = 1.5
    burstiness: float = 1.0  # 1: Poisson; else gamma gaps of this shape (module docstring)
    seed: int = 0
    salt: int = 0  # the run's number: its token ids differ from every other run's
    constrained_fraction: float = 0.0  # share of requests sent with a JSON schema (structured output)
    choices: int = 1  # OpenAI's n: choices per request, sharing the prompt's KV blocks

    def __post_init__(self) -> None:
        if self.choices < 1:
            raise ValueError(f"choices must be >= 1, got {self.choices}")
        if not 0.0 <= self.constrained_fraction <= 1.0:
            raise ValueError(f"constrained_fraction must be in [0, 1], got {self.constrained_fraction}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.workload != "base" and not self.adapters:
            raise ValueError(f"workload {self.workload!r} needs at least one adapter")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {self.rate}")
        if self.num_requests < 1 or self.shared_prefix_len < 0 or self.zipf_alpha <= 0:
            raise ValueError("num_requests must be >= 1, shared_prefix_len >= 0 and zipf_alpha > 0")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0 (1: Poisson arrivals), got {self.burstiness}")
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {self.vocab_size}")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: when to send it (seconds after the run's start), its prompt, its exact
    output length (ignore_eos, max_new_tokens = output_len) and its adapter (None: base)."""

    index: int
    send_at: float
    prompt: tuple[int, ...]
    output_len: int
    adapter: str | None
    constrained: bool = False  # sent with open_loop_clients.CONSTRAINED_SCHEMA as its response format
    choices: int = 1  # OpenAI's n; each choice is output_len tokens

    @property
    def expected_tokens(self) -> int:
        return self.output_len * self.choices


def arrival_offsets(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Send times of a Poisson process of ``rate``/s (gamma gaps of shape ``burstiness`` and mean
    1/rate where it is not 1), the first at 0; all 0 for rate = inf."""
    gaps = rng.exponential(1.0, n) if burstiness == 1.0 else rng.gamma(burstiness, 1.0 / burstiness, n)
    if math.isinf(rate):
        return np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]) / rate


def zipf_weights(n: int, alpha: float) -> np.ndarray:
    """P(rank k) proportional to k^-alpha, k = 1..n."""
    weights = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return weights / weights.sum()


def draw_adapters(workload: str, rng: np.random.Generator, n: int, adapters: tuple[str, ...],
                  alpha: float = 1.5) -> list[str | None]:
    """Each of ``n`` requests' adapter under ``workload`` (module docstring)."""
    if workload == "base":
        return [None] * n
    if workload == "distinct":
        return [adapters[i % len(adapters)] for i in range(n)]
    if workload == "uniform":
        return [adapters[i] for i in rng.integers(0, len(adapters), n)]
    order = rng.permutation(len(adapters))  # which adapter is the k-th most popular
    ranks = rng.choice(len(adapters), size=n, p=zipf_weights(len(adapters), alpha))
    return [adapters[order[k]] for k in ranks]


def random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, n))


def system_prompt(spec: WorkloadSpec, adapter: str | None) -> tuple[int, ...]:
    """The ``shared_prefix_len`` tokens every prompt of ``adapter`` starts with in this run."""
    if spec.shared_prefix_len == 0:
        return ()
    rng = np.random.default_rng([spec.seed, 4, spec.salt, zlib.crc32((adapter or "").encode())])
    return random_ids(rng, spec.shared_prefix_len, spec.vocab_size)


def build_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    """The run's requests in send order."""
    n = spec.num_requests
    timing = np.random.default_rng([spec.seed, 1])
    sends = arrival_offsets(timing, n, spec.rate, spec.burstiness)
    prompt_lens, output_lens = spec.prompt.draw(timing, n), spec.output.draw(timing, n)
    adapters = draw_adapters(spec.workload, np.random.default_rng([spec.seed, 2, len(spec.adapters)]), n,
                             spec.adapters, spec.zipf_alpha)
    tokens = np.random.default_rng([spec.seed, 3, spec.salt])
    prefixes = {a: system_prompt(spec, a) for a in set(adapters)}
    constrained = np.random.default_rng([spec.seed, 5]).random(n) < spec.constrained_fraction
    return [BenchRequest(i, float(sends[i]), prefixes[adapters[i]] + random_ids(tokens, int(prompt_lens[i]),
                                                                               spec.vocab_size),
                         int(output_lens[i]), adapters[i], bool(constrained[i]), spec.choices) for i in range(n)]
