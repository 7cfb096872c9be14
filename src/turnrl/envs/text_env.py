"""``TextEnv``: the base of an environment whose actions are plain text (a Gymnasium-style
text game), with no tools and no stop strings: a subclass writes ``reset`` and ``step``."""

from __future__ import annotations

from abc import ABC, abstractmethod

from turnrl.protocols import ToolSchema
from turnrl.types import Message, StepResult, Task


class TextEnv(ABC):
    """One episode of a game played in words. Make one instance per episode.

    ``reset(task, seed)`` returns the opening messages (often ``list(task.prompt)``);
    ``step(action)`` takes the model's text for one turn and returns a ``StepResult``
    (its observation, reward, and whether the game ended). The model gets no tools
    (``tool_schemas`` is empty) and its turns end where its chat template ends them
    (``stop_strings`` is empty); override either if your game needs it.
    """

    @abstractmethod
    async def reset(self, task: Task, seed: int) -> list[Message]: ...

    @abstractmethod
    async def step(self, action: str) -> StepResult: ...

    def tool_schemas(self) -> list[ToolSchema]:
        return []

    def stop_strings(self) -> tuple[str, ...]:
        return ()
