"""Text games (RAGEN's): Sokoban, FrozenLake and the two-arm bandit, played by tool calls.

Each family is a frozen dataclass: seeded tasks, a fresh ``GameEnv`` per episode, an
oracle, random-content demonstrations, ``chance`` and a card.
"""

from turnrl.envs.games.bandit import Bandit
from turnrl.envs.games.frozen_lake import FrozenLake
from turnrl.envs.games.game_env import Game, GameEnv, Outcome
from turnrl.envs.games.sokoban import Sokoban

__all__ = ["Bandit", "FrozenLake", "Game", "GameEnv", "Outcome", "Sokoban"]
