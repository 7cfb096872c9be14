"""Plain data that crosses layer boundaries: tasks, messages, turns, trajectories.

Everything here is frozen or append-only data with no behaviour beyond small derived
views, and no torch: environment authors can use these types without an ML stack.
Token ids and log-probabilities are plain Python lists so a trajectory serialises to JSON
exactly as it was sampled (docs/design.md, invariant 1: training never re-tokenizes text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]

Message = dict[str, Any]
"""A chat message in the OpenAI shape: ``{"role": ..., "content": ...}`` plus optional keys
(``name``, ``tool_call_id``). A dict, not a class, because chat templates consume dicts."""

FinishReason = Literal["stop", "length"]
"""Why a backend stopped one completion: a stop token/string (``stop``) or its token budget."""

StopReason = Literal[
    "answered",  # the environment terminated the episode (task over, success or not)
    "max_turns",  # the turn limit ended it
    "max_tokens_per_turn",  # one completion hit its token budget
    "max_episode_tokens",  # the episode's total token budget ran out
    "max_context",  # the next prompt would not fit the model's context
    "env_truncated",  # the environment itself truncated (its own limit)
    "error",  # an infrastructure failure; see Trajectory.error
]


@dataclass(frozen=True, init=False)
class Task:
    """One problem instance: what the model is asked and what the verifier needs.

    ``prompt`` holds the opening messages: given as a string, it is one user message
    (``Task(id="t0", prompt="What is 3 times 4?", answer="12")``); given as messages (a
    tuple or list of ``{"role", "content"}`` dicts), those, kept as a tuple. ``answer`` is
    whatever the environment's verifier compares against; it is never shown to the model.
    """

    id: str
    prompt: tuple[Message, ...]
    answer: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __init__(
        self,
        id: str,
        prompt: str | Sequence[Message],
        answer: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        messages: tuple[Message, ...]
        if isinstance(prompt, str):
            messages = ({"role": "user", "content": prompt},)
        else:
            given: object = prompt
            if not isinstance(given, Sequence) or not all(isinstance(m, Mapping) for m in given):
                raise TypeError(
                    "Task.prompt must be a string (one user message) or a sequence of "
                    f"message dicts, got {type(prompt).__name__}"
                )
            messages = tuple(prompt)
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "prompt", messages)
        object.__setattr__(self, "answer", answer)
        object.__setattr__(self, "metadata", {} if metadata is None else metadata)


@dataclass(frozen=True)
class StepResult:
    """What ``Env.step`` returns (Gymnasium's semantics with named fields).

    ``terminated``: the task reached an end state (answered, solved, failed for good).
    ``truncated``: a limit ended it before a natural end. Both may be False (keep going).
    ``observation`` messages are appended to the conversation and shown to the model.
    ``context``, when given, replaces the whole conversation instead: the environment
    rewrote the history (an agent that summarised or dropped earlier turns). The next turn
    then starts a new training sample from ``context`` rendered afresh (never re-tokenized
    sampled text), counted as ``rollout/context_rewrites``; ``observation`` is ignored.
    """

    observation: tuple[Message, ...] = ()
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)
    context: tuple[Message, ...] | None = None


@dataclass(frozen=True)
class ToolCall:
    """A call parsed out of model text: the tool's name and its JSON arguments."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ToolCallRecord:
    """What happened when one call ran: kept on the trajectory for metrics and the report."""

    name: str
    arguments: Mapping[str, Any]
    latency_s: float
    ok: bool
    error: str | None = None
    isolated: bool | None = None
    """For code-running tools: True in an isolating sandbox, False in the rlimit-only
    fallback (which does not isolate); None for tools that run no untrusted code."""


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to sample: the full context as token ids and the sampling settings.

    ``seed`` makes the sample reproducible independently of what else is in the batch.
    ``stop_token_ids`` end the completion and are included in it (the model sampled them).
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A backend's answer to one request: the sampled token ids with their log-probs.

    ``logprobs[i]`` is log pi(token_ids[i]) under the distribution the token was sampled from
    (temperature applied, before top-p truncation), which is what the learner recomputes.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    text: str = ""
    policy_version: int | None = None
    """The version of the weights that sampled it, where the backend knows it."""


@dataclass(frozen=True)
class Turn:
    """One model turn: the tokens fed in before it and the tokens it sampled.

    ``prompt_ids`` are the tokens added to the context since the previous completion
    (the whole prompt for the first turn or after a template break): loss mask 0.
    ``completion_ids`` were sampled by the policy: loss mask 1. ``new_sample`` marks a turn
    whose context is not a continuation of the previous turn (template break): it starts a
    separate training sample.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    completion_logprobs: tuple[float, ...]
    finish_reason: FinishReason
    text: str = ""
    new_sample: bool = False
    policy_version: int = 0
    """The policy version that sampled this turn (the backend's, else the episode's)."""


@dataclass(frozen=True)
class Sample:
    """A token-exact training sequence cut from a trajectory.

    ``loss_mask[i]`` is 1 exactly where ``input_ids[i]`` was sampled by the policy;
    ``logprobs[i]`` is the sampler's log-prob there and 0.0 elsewhere.
    """

    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass
class Trajectory:
    """Everything one episode produced, token-exact, plus how it ended.

    A failed infrastructure call sets ``error`` and ``stop_reason == "error"``; such a
    trajectory is kept (a bad rollout is data) but excluded from training by a counted rule.
    """

    task_id: str
    sample_index: int
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    stop_reason: StopReason | None = None
    error: str | None = None
    policy_version: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    template_breaks: int = 0
    context_rewrites: int = 0
    """Turns after which the environment replaced the conversation (``StepResult.context``)."""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that sampled one of its turns (``policy_version``
        before any turn): its staleness. With partial rollouts later turns may be newer."""
        return min((turn.policy_version for turn in self.turns), default=self.policy_version)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def num_tokens(self) -> int:
        return sum(len(t.prompt_ids) + len(t.completion_ids) for t in self.turns)

    def samples(self) -> list[Sample]:
        """The training sequences: one per run of contiguous turns (usually exactly one)."""
        out: list[Sample] = []
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        for turn in self.turns:
            if turn.new_sample and ids:
                out.append(Sample(tuple(ids), tuple(mask), tuple(lps)))
                ids, mask, lps = [], [], []
            ids.extend(turn.prompt_ids)
            mask.extend([0] * len(turn.prompt_ids))
            lps.extend([0.0] * len(turn.prompt_ids))
            ids.extend(turn.completion_ids)
            mask.extend([1] * len(turn.completion_ids))
            lps.extend(turn.completion_logprobs)
        if ids:
            out.append(Sample(tuple(ids), tuple(mask), tuple(lps)))
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (token ids and log-probs kept exactly)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Trajectory:
        d = dict(data)
        d["turns"] = [
            Turn(
                prompt_ids=tuple(t["prompt_ids"]),
                completion_ids=tuple(t["completion_ids"]),
                completion_logprobs=tuple(t["completion_logprobs"]),
                finish_reason=t["finish_reason"],
                text=t.get("text", ""),
                new_sample=t.get("new_sample", False),
                policy_version=t.get("policy_version", 0),
            )
            for t in d.get("turns", [])
        ]
        d["tool_calls"] = [ToolCallRecord(**c) for c in d.get("tool_calls", [])]
        return cls(**d)
