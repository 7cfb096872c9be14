"""A LangGraph agent, trained as it is (`pip install 'turnrl[agents]'`).

The agent answers "What is the value of <key>?" with its own `lookup` tool, written
LangGraph's way: a LangChain `@tool`, a `ChatOpenAI` model bound to it, and the ReAct
graph (a model node, a `ToolNode`, `tools_condition` between them) that loops until the
model answers without a call. The one thing that connects it to turnrl is the model's
`base_url`: the episode's policy endpoint. A graph that loops past its `recursion_limit`
raises `GraphRecursionError`; turnrl counts that episode as the model's failure (reward 0,
trained on, `rollout/agent_model_errors`) rather than a bug.
"""

import sys

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import turnrl
from turnrl.envs import SecretLookup


async def agent(task: turnrl.Task, *, base_url: str, api_key: str) -> str:
    """A LangGraph ReAct graph with one tool (nothing here knows about turnrl but the URL)."""
    table = task.metadata["table"]  # the agent's own tool reads its own data

    @tool
    def lookup(key: str) -> str:
        """Look up a key."""
        return table.get(key, f"Error: no key {key!r} in the table")

    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key).bind_tools([lookup])

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([lookup]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # a call: tools; else the end
    graph.add_edge("tools", "model")
    question = {"messages": [("user", task.prompt[0]["content"])]}
    state = await graph.compile().ainvoke(question, {"recursion_limit": 8})  # 4 model turns
    return str(state["messages"][-1].content)


def reward(task: turnrl.Task, answer: str, transcript: list) -> float:
    return float(answer.strip() == task.answer)


PROBE = SecretLookup(num_keys=2, key_pool=2, num_values=12)  # the quick-start's tasks

if __name__ == "__main__":  # python examples/langgraph_agent.py [key=value ...]
    env = turnrl.AgentEnvironment(agent, PROBE.task, reward, name="langgraph",
                                  demonstrate=PROBE.demonstration, corpus_text=PROBE.corpus())  # fmt: skip
    try:
        turnrl.train("quickstart", env=env, overrides=sys.argv[1:])
    finally:
        env.close()
