"""search_qa: the contract check, that each hop needs its own search, reward-hacking
probes against the verifier, and a user's corpus + QA files."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from turnrl.envs import check_env, make_env_family
from turnrl.envs.policy import play, replay
from turnrl.envs.search_qa import SearchQA
from turnrl.errors import ConfigError
from turnrl.rewards import normalize_qa, qa_f1, qa_verdict


@pytest.mark.parametrize(
    "options",
    [{}, {"min_hops": 1, "max_hops": 1}, {"min_hops": 3, "max_hops": 3, "format": "hermes"}],
)
def test_the_contract_check_passes(options: dict[str, object]) -> None:
    report = check_env(make_env_family("search_qa", **options), num_tasks=30)
    assert report.ok, report.table()
    assert report.oracle_success == 1.0
    assert report.random_success <= 0.05


def test_tasks_are_seeded_and_hops_are_drawn_in_range() -> None:
    spec = SearchQA(min_hops=2, max_hops=3)
    assert spec.task(5, "test") == SearchQA(min_hops=2, max_hops=3).task(5, "test")
    assert spec.task(5, "test") != SearchQA(min_hops=2, max_hops=3, seed=1).task(5, "test")
    hops = {spec.task(i).metadata["hops"] for i in range(60)}
    assert hops == {2, 3}
    task = spec.task(0)
    chain = task.metadata["chain"]
    assert len(chain) == task.metadata["hops"] + 1
    assert chain[0] in task.metadata["question"]
    assert not any(name in task.metadata["question"] for name in chain[1:])


def test_each_hop_needs_its_own_search() -> None:
    # Searching the question finds the first entity's article, not the answer; searching
    # each entity of the chain in turn shows it.
    spec = SearchQA(min_hops=2, max_hops=3)
    search = spec.index.as_tool(k=spec.top_k, snippet_chars=spec.snippet_chars)

    def results(query: str) -> str:
        return asyncio.run(search.invoke({"query": query})).content

    tasks = [spec.task(i, "test") for i in range(100)]
    by_question = sum(str(t.answer) in results(t.metadata["question"]) for t in tasks)
    by_chain = sum(
        str(t.answer) in " ".join(results(name) for name in t.metadata["chain"][:-1]) for t in tasks
    )
    assert by_chain == 100
    assert by_question <= 10


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        ("Kesmor", 1.0),
        ("  the KESMOR. ", 1.0),  # case, article and punctuation are normalised away
        ("Kesmor, Velmor, Tarvonia", 0.0),  # a list of candidates
        ("I think it is Kesmor but maybe Velmor", 0.0),  # the gold buried in a sentence
        ("", 0.0),  # format only: an empty answer
        ("the", 0.0),  # only an article: normalises to nothing
        ("Kesmo", 0.0),
    ],
)
def test_the_verifier_cannot_be_gamed(answer: str, reward: float) -> None:
    assert qa_verdict(answer, ["Kesmor"]).reward == reward


def test_f1_is_logged_but_does_not_pay() -> None:
    verdict = qa_verdict("Kesmor and Velmor", "Kesmor")
    assert verdict.reward == 0.0
    assert verdict.components["f1"] == pytest.approx(0.5)  # precision 1/3, recall 1
    assert qa_f1("Dara Velmon", ["x", "Velmon Dara"]) == 1.0  # best over golds
    assert normalize_qa("An Apple, the Pie!") == "apple pie"


def test_a_format_only_episode_scores_zero() -> None:
    spec = SearchQA(max_hops=1)
    task = spec.task(0, "test")
    for turns in (["<answer></answer>"], ["<search>x</search>", "<answer>unknown</answer>"]):
        episode = asyncio.run(play(spec.make_env(), task, replay(turns), seed=0, max_steps=4))
        assert episode.reward == 0.0


def test_the_search_budget_is_enforced() -> None:
    spec = SearchQA(max_hops=1, max_searches=2)
    task = spec.task(0)
    episode = asyncio.run(
        play(
            spec.make_env(),
            task,
            replay(["<search>a</search>"] * 3, then="<answer>x</answer>"),
            seed=0,
            max_steps=5,
        )
    )
    assert "tool budget exhausted" in str(episode.results[2].observation[0]["content"])


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_a_users_corpus_and_questions(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [
        {"id": "1", "contents": '"Oslo"\nOslo is the capital of Norway.'},
        {"id": "2", "title": "Bergen", "text": "Bergen is a rainy city on the west coast."},
        {"id": "3", "title": "Tromso", "text": "Tromso lies north of the Arctic Circle."},
    ])  # fmt: skip
    qa = write_jsonl(tmp_path / "qa.jsonl", [
        {"id": "q1", "question": "What is the capital of Norway?", "answer": "Oslo"},
        {"question": "Which city is rainy?", "golden_answers": ["Bergen", "Bergen, Norway"]},
        *({"question": f"Question {i}?", "answer": "Tromso"} for i in range(6)),
    ])  # fmt: skip
    spec = SearchQA(corpus_path=corpus, qa_path=qa)
    tasks = [spec.task(i) for i in range(16)]
    # every question once per pass over the file, in a seeded order
    assert sorted(t.metadata["source_id"] for t in tasks[:8]) == sorted(
        t.metadata["source_id"] for t in tasks[8:]
    )
    first = next(t for t in tasks if t.metadata["source_id"] == "q1")
    second = next(t for t in tasks if t.metadata["source_id"] == "2")
    assert first.answer == "Oslo"
    assert second.answer == ("Bergen", "Bergen, Norway")
    assert spec.index.search("Arctic")[0].document.title == "Tromso"
    report = check_env(spec, num_tasks=4)
    assert report.ok, report.table()
    env = spec.make_env()
    episode = asyncio.run(
        play(
            env,
            second,
            replay(["<search>rainy</search>", "<answer>Bergen, Norway</answer>"]),
            seed=0,
            max_steps=3,
        )
    )
    assert episode.reward == 1.0


def test_relations_restrict_the_question_shapes() -> None:
    spec = SearchQA(max_hops=1, relations=("born_in",))
    assert {spec.task(i).metadata["relations"][0] for i in range(30)} == {"born_in"}
    with pytest.raises(ConfigError, match="unknown"):
        SearchQA(relations=("married_to",))
    with pytest.raises(ConfigError, match="no 2-hop question"):
        SearchQA(min_hops=2, max_hops=2, relations=("born_in",)).task(0)


def test_a_world_per_task_leaves_nothing_to_memorise() -> None:
    spec = SearchQA(max_hops=1, relations=("born_in",), people=6, cities=4, countries=2,
                    companies=2, world_per_task=True)  # fmt: skip
    tasks = [spec.task(i, "test") for i in range(300)]
    answers = Counter(str(t.answer) for t in tasks)
    assert answers.most_common(1)[0][1] <= 3  # no answer worth guessing
    report = check_env(spec, num_tasks=30)  # the oracle's searches hit each task's world
    assert report.ok, report.table()
    assert report.oracle_success == 1.0
    shared = SearchQA(max_hops=1, relations=("born_in",), people=6, cities=4, countries=2,
                      companies=2)  # fmt: skip
    mode = Counter(str(shared.task(i, "test").answer) for i in range(300)).most_common(1)[0][1]
    assert mode >= 60  # one small shared world: a single guess already wins often


def test_search_shaping_rewards_the_right_search_but_the_answer_dominates() -> None:
    spec = SearchQA(max_hops=1, search_reward=0.3)
    task = spec.task(0)
    entity, gold = task.metadata["chain"][0], str(task.answer)

    def reward(turns: list[str]) -> float:
        return asyncio.run(play(spec.make_env(), task, replay(turns), seed=0, max_steps=4)).reward

    right = f"<search>{entity}</search>"
    assert reward([right, f"<answer>{gold}</answer>"]) == pytest.approx(1.3)
    assert reward([right, "<answer>nobody</answer>"]) == pytest.approx(0.3)
    assert reward(["<answer>nobody</answer>"]) == pytest.approx(-0.3)  # no search at all
    assert reward([f"<answer>{gold}</answer>"]) == pytest.approx(0.7)  # right, unsearched
    assert check_env(spec, num_tasks=20).ok
    with pytest.raises(ConfigError, match="search_reward"):
        SearchQA(search_reward=0.8)


def test_retrieval_shaping_pays_for_finding_the_article_not_for_searching() -> None:
    spec = SearchQA(max_hops=1, relations=("born_in",), people=6, cities=4, countries=2,
                    companies=2, world_per_task=True, top_k=1, max_searches=2,
                    search_reward=0.3, search_shaping="retrieval")  # fmt: skip
    task = spec.task(0)
    entity, gold = task.metadata["chain"][0], str(task.answer)
    surname = entity.split()[-1]
    other = next(p for p in spec._world(*task.metadata["world"]).kinds if p not in (entity, gold))

    def episode(turns: list[str]) -> tuple[float, dict[str, float]]:
        result = asyncio.run(play(spec.make_env(), task, replay(turns), seed=0, max_steps=4))
        return result.reward, result.results[-1].info.get("reward_components", {})

    assert episode([f"<search>{entity}</search>", f"<answer>{gold}</answer>"])[0] == (
        pytest.approx(1.3)
    )
    # one word of the name finds the article: the term is graded by what the search found
    reward, parts = episode([f"<search>{surname}</search>", "<answer>nobody</answer>"])
    assert reward == pytest.approx(0.3)
    assert parts["retrieved"] == 1.0
    assert episode([f"<search>{other}</search>", "<answer>nobody</answer>"])[0] == 0.0
    assert episode(["<answer>nobody</answer>"])[0] == 0.0  # no search: nothing, not negative
    assert episode([f"<answer>{gold}</answer>"])[0] == pytest.approx(1.0)
    # searches past the budget were refused: they found nothing and earn nothing
    reward, parts = episode([f"<search>{other}</search>", f"<search>{other}</search>",
                             f"<search>{entity}</search>", "<answer>nobody</answer>"])  # fmt: skip
    assert parts["retrieved"] == 0.0
    assert reward == 0.0
    assert spec.reward_range == (0.0, 1.3)
    assert check_env(spec, num_tasks=20).ok
    with pytest.raises(ConfigError, match="search_shaping"):
        SearchQA(search_shaping="bm25")


def test_demonstrations_copy_random_content_from_the_context() -> None:
    """The warm-up's random policy searches a word of the question and answers a name that
    search brought back: never the gold by construction, never a name the model cannot see."""
    spec = SearchQA(max_hops=1, relations=("born_in",), people=6, cities=4, countries=2,
                    companies=2, world_per_task=True, top_k=1)  # fmt: skip
    right = 0
    queries = set()
    for i in range(200):
        task = spec.task(i)
        search, answer = spec.demonstration(task, random.Random(i))
        query = search.removeprefix("<search>").removesuffix("</search>")
        name = answer.removeprefix("<answer>").removesuffix("</answer>")
        assert (
            query in task.metadata["question"].split() or f"{query}?" in task.metadata["question"]
        )
        hits = spec._index_for(task).search(query, 1)
        assert name in " ".join(h.document.text for h in hits) or name in task.metadata["question"]
        queries.add(query)
        right += name == task.answer
    assert len(queries) > 10  # the question's words, names included, at random
    assert 0 < right / 200 < 0.25  # the random policy sometimes succeeds, rarely


def test_bad_options_and_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="min_hops"):
        SearchQA(min_hops=2, max_hops=1)
    with pytest.raises(ConfigError, match="format"):
        SearchQA(format="react")
    with pytest.raises(ConfigError, match="together"):
        SearchQA(qa_path="qa.jsonl")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}])
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q?", "answer": []}])
    with pytest.raises(ConfigError, match=r"qa.jsonl:1: expected an object"):
        SearchQA(corpus_path=corpus, qa_path=qa).task(0)
