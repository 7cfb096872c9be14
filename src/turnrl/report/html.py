"""``report.html``: one self-contained page per run, viewable with no network.

It holds where the run ran (learner ranks, rollout workers, how far rollouts ran ahead);
the run's learning curves as inline SVG (reward, success, each reward component, entropy,
in-group reward std, gradient norm, clip fraction, tool-call rate, turns, lengths,
throughput, staleness, weight syncs, ...) with the monitors' alarms marked where they
fired; the alarms with their advice; an evaluation table; and a trajectory viewer:
episodes sampled evenly over the run, filtered by step, reward and text, each shown turn
by turn with its tokens: the model's sampled tokens (trained on) and the prompt and
observation tokens (masked) look different, each sampled token's log-probability shows
on hover, and the tool calls, results, reward components and stop reason are listed.

It reads ``metrics.jsonl``, ``alarms.jsonl``, ``trajectories.jsonl`` and ``config.json``,
so it works on a finished, running or killed run; tokens are decoded with the run's
tokenizer when one is found (else shown as ids).
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from turnrl.trainer.monitors import read_rows

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("success", ("rollout/success_mean", "eval/success_mean")),
    ("reward", ("rollout/reward_mean", "eval/reward_mean")),
    ("reward components", ("rollout/reward/*",)),
    ("in-group reward spread", ("rollout/reward_std_in_group", "rollout/zero_variance_groups_frac")),
    ("entropy", ("loss/entropy",)),
    ("KL to reference", ("loss/kl",)),
    ("gradient norm", ("train/grad_norm",)),
    ("clip fraction", ("train/clip_frac",)),
    ("sampler/learner mismatch", ("train/logprob_mismatch",)),
    ("tool use", ("rollout/tool_calls_mean", "rollout/tool_errors_frac")),
    ("turns and truncation", ("rollout/turns_mean", "rollout/truncated_frac")),
    ("completion length (tokens)", ("rollout/completion_tokens_mean",)),
    ("throughput (tokens/s)", ("perf/tokens_per_s",)),
    ("step time (s)", ("perf/step_s", "perf/rollout_s", "perf/rollout_wait_s")),
    ("policy versions behind the learner",
     ("rollout/policy_lag_mean", "rollout/policy_lag_max", "rollout/policy_lag_tokens_mean")),
    ("trajectories by versions behind (fraction)", ("rollout/staleness_*",)),
    ("weight sync (s)", ("perf/weight_sync_s", "perf/rollout_sync_s", "perf/rollout_offer_s",
                         "perf/mid_batch_sync_s")),
    ("rollout worker restarts", ("rollout/worker_restarts",)),
)  # fmt: skip
SHOWN_IF_NONZERO = {"rollout worker restarts"}
"""Panels drawn only where a value is not 0 (a flat zero says nothing a missing panel
does not)."""
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
MAX_STEPS_SHOWN = 24
"""Steps whose episodes the viewer holds (evenly spaced over the run)."""
EPISODES_PER_STEP = 6
PROMPT_TOKENS_SHOWN = 300
"""The first turn's prompt is cut to its last this-many tokens (system prompt, tools)."""


def write_html_report(run_dir: Path) -> Path:
    """Write ``report.html`` in ``run_dir`` and return its path."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir / "metrics.jsonl")
    alarms = read_rows(run_dir / "alarms.jsonl")
    config = _config(run_dir)
    episodes = _episodes(run_dir, _decoder(run_dir, config))
    title = f"turnrl run: {run_dir.name}"
    body = [
        f"<h1>{_e(title)}</h1>",
        _overview(config, rows),
        "<h2>Learning curves</h2>",
        "<p class='note'>Red dashed lines mark alarms (hover for the alarm).</p>",
        "<div id='curves' class='grid'>", *_panels(rows, alarms), "</div>",
        "<h2>Alarms</h2>", _alarm_table(alarms),
        "<h2>Evaluation</h2>", _eval_table(rows),
        "<h2>Trajectories</h2>", _viewer(episodes),
    ]  # fmt: skip
    page = (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
        + "\n".join(body)
        + f"<script>{JS}</script></body></html>"
    )
    out = run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _config(run_dir: Path) -> dict[str, Any]:
    try:
        loaded = json.loads((run_dir / "config.json").read_text())
        return loaded if isinstance(loaded, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _overview(config: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    env = config.get("env", {})
    algo = config.get("algorithm", {})
    facts = [
        ("environment", f"{env.get('name', '?')} {json.dumps(env.get('options', {}))}"),
        ("advantage / loss", f"{algo.get('advantage', '?')} / {algo.get('policy_loss', 'ppo')}"),
        ("layout", layout(config)),
        ("steps logged", str(len(rows))),
    ]
    last = rows[-1] if rows else {}
    for key in ("rollout/success_mean", "rollout/reward_mean", "perf/elapsed_s"):
        if key in last:
            facts.append((f"last {key}", f"{last[key]:.4g}"))
    evals = [r for r in rows if "eval/success_mean" in r]
    if evals:
        facts.append(("held-out success", f"{evals[0]['eval/success_mean']:.3f} (step "
                      f"{evals[0]['step']}) -> {evals[-1]['eval/success_mean']:.3f} (step "
                      f"{evals[-1]['step']})"))  # fmt: skip
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
    return f"<table class='facts'>{cells}</table>"


def layout(config: dict[str, Any]) -> str:
    """Where the run's parts ran and how far its rollouts ran ahead, in words, from its
    ``config.json``: ``in process, synchronous`` or, say, ``2 learner ranks (FSDP2), 2
    rollout workers (weight_sync auto), asynchronous: max_staleness 2, partial
    rollouts``."""
    c, algo = config.get("cluster", {}), config.get("algorithm", {})
    parts = []
    if c.get("learner_ranks", 0):
        where = " on Ray" if c.get("learner_placement") == "ray" else ""
        parts.append(f"{c['learner_ranks']} learner rank(s) (FSDP2{where})")
    if c.get("rollout_workers", 0):
        sync = c.get("weight_sync", "?")
        parts.append(f"{c['rollout_workers']} rollout worker(s) (weight_sync {sync})")
    if c.get("address"):
        parts.append(f"Ray cluster {c['address']}")
    k = algo.get("max_staleness", 0)
    timing = "synchronous"
    if k:
        timing = f"asynchronous: max_staleness {k}"
        timing += ", partial rollouts" if algo.get("partial_rollouts") else ""
        timing += ", overlapping batches" if algo.get("overlap_batches") else ""
    return ", ".join(parts or ["in process"]) + ", " + timing


def _series(rows: Sequence[dict[str, Any]], pattern: str) -> dict[str, list[tuple[float, float]]]:
    if pattern.endswith("*"):
        keys = sorted({k for r in rows for k in r if k.startswith(pattern[:-1])})
    else:
        keys = [pattern]
    out: dict[str, list[tuple[float, float]]] = {}
    for key in keys:
        points = [(float(r["step"]), float(r[key])) for r in rows
                  if isinstance(r.get(key), (int, float)) and r[key] == r[key]]  # fmt: skip
        if points:
            out[key] = points
    return out


def _panels(rows: Sequence[dict[str, Any]], alarms: Sequence[dict[str, Any]]) -> list[str]:
    panels = []
    for title, patterns in PANELS:
        series: dict[str, list[tuple[float, float]]] = {}
        for pattern in patterns:
            series.update(_series(rows, pattern))
        if not series:
            continue
        if title in SHOWN_IF_NONZERO and not any(y for pts in series.values() for _, y in pts):
            continue
        marks = [a for a in alarms if a.get("metric") in series]
        panels.append(svg_chart(title, series, marks))
    return panels


def svg_chart(
    title: str, series: dict[str, list[tuple[float, float]]], alarms: Sequence[dict[str, Any]] = ()
) -> str:
    """A line chart as inline SVG: one polyline per series, alarms as dashed red lines."""
    w, h, left, right, top, bottom = 420, 230, 52, 12, 26, 58
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (w - left - right)

    def py(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom)

    parts = [f"<svg class='chart' width='{w}' height='{h}' viewBox='0 0 {w} {h}' role='img' "
             f"aria-label='{_e(title)}'><text x='{left}' y='16' class='title'>{_e(title)}</text>",
             f"<rect x='{left}' y='{top}' width='{w - left - right}' height='{h - top - bottom}' "
             "class='frame'/>"]  # fmt: skip
    for value in (y0 + pad, (y0 + y1) / 2, y1 - pad):
        parts.append(f"<text x='{left - 4}' y='{py(value) + 4:.1f}' class='tick' "
                     f"text-anchor='end'>{value:.3g}</text>")  # fmt: skip
    for value in (x0, x1):
        parts.append(f"<text x='{px(value):.1f}' y='{h - bottom + 14}' class='tick' "
                     f"text-anchor='middle'>{value:.0f}</text>")  # fmt: skip
    for alarm in alarms:
        step = float(alarm.get("step", x0))
        label = (
            f"{alarm.get('name')} at step {alarm.get('step')}: {alarm.get('metric')} = "
            f"{alarm.get('value')} (threshold {alarm.get('threshold')})"
        )
        parts.append(f"<line x1='{px(step):.1f}' x2='{px(step):.1f}' y1='{top}' "
                     f"y2='{h - bottom}' class='alarm'><title>{_e(label)}</title></line>")  # fmt: skip
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        if len(pts) == 1:
            ((x, y),) = pts
            parts.append(f"<circle cx='{px(x):.1f}' cy='{py(y):.1f}' r='3' fill='{color}'/>")
        else:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            parts.append(f"<polyline points='{path}' fill='none' stroke='{color}' "
                         "stroke-width='1.5'/>")  # fmt: skip
        ly = h - bottom + 28 + 12 * (i % 3)
        lx = left + (i // 3) * 190
        parts.append(f"<text x='{lx}' y='{ly}' class='legend' fill='{color}'>{_e(name)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _alarm_table(alarms: Sequence[dict[str, Any]]) -> str:
    if not alarms:
        return "<p class='note'>No alarm fired.</p>"
    head = (
        "<tr><th>step</th><th>alarm</th><th>metric</th><th>value</th><th>threshold</th>"
        "<th>what users usually do</th></tr>"
    )
    rows = "".join(
        f"<tr><td>{_e(a.get('step'))}</td><td>{_e(a.get('name'))}</td><td>{_e(a.get('metric'))}"
        f"</td><td>{_num(a.get('value'))}</td><td>{_num(a.get('threshold'))}</td>"
        f"<td>{_e(a.get('advice', ''))}</td></tr>"
        for a in alarms
    )
    return f"<table class='data' id='alarms'>{head}{rows}</table>"


def _num(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else _e(value)


def _eval_table(rows: Sequence[dict[str, Any]]) -> str:
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if not evals:
        return "<p class='note'>No evaluation was run.</p>"
    keys = sorted({k for r in evals for k in r if k.startswith("eval/")})
    head = "<tr><th>step</th>" + "".join(f"<th>{_e(k)}</th>" for k in keys) + "</tr>"
    body = "".join(
        f"<tr><td>{r['step']}</td>"
        + "".join(f"<td>{_num(r.get(k, ''))}</td>" for k in keys)
        + "</tr>"
        for r in evals
    )
    return f"<table class='data' id='evals'>{head}{body}</table>"


class _Decoder:
    """Token ids to text pieces, with the run's tokenizer when there is one."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        if token_id not in self.cache:
            if self.tokenizer is None:
                self.cache[token_id] = f"[{token_id}]"
            else:
                self.cache[token_id] = str(self.tokenizer.decode([token_id]))
        return self.cache[token_id]


def _decoder(run_dir: Path, config: dict[str, Any]) -> _Decoder:
    candidates = [run_dir / "start_model", run_dir / "base_model"]
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"),
                         key=lambda p: int(p.name.split("_")[-1]) if p.name.split("_")[-1].isdigit() else 0)  # fmt: skip
    candidates += checkpoints[-1:]
    path = config.get("model", {}).get("path")
    if path:
        candidates.append(Path(path))
    for candidate in candidates:
        if (candidate / "tokenizer_config.json").is_file():
            try:
                from turnrl.models.loading import load_tokenizer

                return _Decoder(load_tokenizer(candidate))
            except Exception:  # an unreadable tokenizer: fall back to ids
                continue
    return _Decoder(None)


_STEP_RE = re.compile(rb'^\{"step": (\d+)')


def _episodes(run_dir: Path, decoder: _Decoder) -> list[dict[str, Any]]:
    """Up to EPISODES_PER_STEP episodes of up to MAX_STEPS_SHOWN steps spread over the run."""
    path = run_dir / "trajectories.jsonl"
    if not path.is_file():
        return []
    steps: list[int] = []
    with path.open("rb") as f:
        for line in f:
            found = _STEP_RE.match(line)
            if found and (not steps or steps[-1] != int(found[1])):
                steps.append(int(found[1]))
    chosen = set(_spread(sorted(set(steps)), MAX_STEPS_SHOWN))
    taken: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    with path.open("rb") as f:
        for line in f:
            found = _STEP_RE.match(line)
            if not found or int(found[1]) not in chosen:
                continue
            step = int(found[1])
            if taken.get(step, 0) >= EPISODES_PER_STEP:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            taken[step] = taken.get(step, 0) + 1
            out.append(_episode_view(row, decoder))
    return out


def _spread(values: Sequence[int], count: int) -> list[int]:
    if len(values) <= count:
        return list(values)
    return [values[round(i * (len(values) - 1) / (count - 1))] for i in range(count)]


def _episode_view(row: dict[str, Any], decoder: _Decoder) -> dict[str, Any]:
    turns = []
    for i, turn in enumerate(row.get("turns", [])):
        prompt = list(turn.get("prompt_ids", []))
        cut = 0
        if i == 0 and len(prompt) > PROMPT_TOKENS_SHOWN:
            cut, prompt = len(prompt) - PROMPT_TOKENS_SHOWN, prompt[-PROMPT_TOKENS_SHOWN:]
        turns.append({
            "cut": cut,
            "prompt": [decoder.piece(t) for t in prompt],
            "completion": [[decoder.piece(t), round(float(lp), 4)] for t, lp in
                           zip(turn.get("completion_ids", []), turn.get("completion_logprobs", []), strict=False)],
            "finish": turn.get("finish_reason"),
        })  # fmt: skip
    calls = [
        {"name": c.get("name"), "arguments": c.get("arguments"), "ok": c.get("ok"),
         "error": c.get("error")}
        for c in row.get("tool_calls", [])
    ]  # fmt: skip
    return {
        "step": row.get("step"), "task": row.get("task_id"), "sample": row.get("sample_index"),
        "reward": row.get("reward"), "success": row.get("success"),
        "advantage": _rounded(row.get("advantage")), "stop": row.get("stop_reason"),
        "error": row.get("error"), "components": row.get("reward_components", {}),
        "calls": calls, "turns": turns,
        "env": (row.get("info") or {}).get("env", ""),
    }  # fmt: skip


def _clean(value: Any) -> Any:
    """JSON that browsers parse: non-finite floats (NaN, inf) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _rounded(value: Any) -> Any:
    """An advantage (a number, or one per turn for turn-level credit) to 3 decimals."""
    if isinstance(value, (int, float)):
        return round(float(value), 3)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return None


def _viewer(episodes: Iterable[dict[str, Any]]) -> str:
    data = json.dumps(_clean(list(episodes)), ensure_ascii=False, allow_nan=False)
    data = data.replace("</", "<\\/")
    return (
        "<div id='viewer'>"
        "<div class='filters'>step <select id='f-step'><option value=''>all</option></select> "
        "min reward <input id='f-reward' type='number' step='0.1'> "
        "text <input id='f-text' placeholder='task id, tool, token text'> "
        "<span id='f-count'></span></div>"
        "<div class='split'><table class='data' id='episode-list'></table>"
        "<div id='episode'><p class='note'>Click an episode.</p></div></div>"
        "<p class='note legend-tokens'><span class='tok sampled'>sampled (trained on; hover: "
        "log-prob)</span> <span class='tok masked'>prompt / observation (masked)</span></p>"
        f"<script type='application/json' id='episode-data'>{data}</script></div>"
    )


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:20px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
.note{color:#666}.grid{display:flex;flex-wrap:wrap;gap:8px}
.chart .frame{fill:#fafafa;stroke:#ccc}.chart .title{font-weight:600;font-size:13px}
.chart .tick,.chart .legend{font-size:10px}.chart .alarm{stroke:#d00;stroke-dasharray:4 3;stroke-width:1.5}
table.facts th{text-align:left;padding-right:12px}
table.data{border-collapse:collapse;font-size:12px}table.data td,table.data th{border:1px solid #ddd;padding:2px 6px}
#episode-list tr{cursor:pointer}#episode-list tr:hover{background:#eef}#episode-list tr.on{background:#dde}
.split{display:flex;gap:16px;align-items:flex-start}#episode-list{max-height:600px;overflow:auto;display:block}
#episode{flex:1;min-width:0}.turn{border:1px solid #ddd;margin:6px 0;padding:6px;white-space:pre-wrap;
font-family:ui-monospace,monospace;font-size:12px;word-break:break-all}
.tok.sampled{background:#d7f5d7;border-bottom:1px solid #2a2}.tok.masked{background:#eee;color:#666}
.filters{margin:6px 0}.ok{color:#080}.bad{color:#b00}
"""

JS = """
(function () {
  var holder = document.getElementById('episode-data');
  if (!holder) { return; }
  var episodes = JSON.parse(holder.textContent);
  var list = document.getElementById('episode-list');
  var view = document.getElementById('episode');
  var fStep = document.getElementById('f-step');
  var fReward = document.getElementById('f-reward');
  var fText = document.getElementById('f-text');
  var steps = [];
  episodes.forEach(function (e) { if (steps.indexOf(e.step) < 0) { steps.push(e.step); } });
  steps.forEach(function (s) {
    var o = document.createElement('option'); o.value = String(s); o.textContent = String(s);
    fStep.appendChild(o);
  });
  function text(e) {
    var parts = [e.task, e.stop || ''];
    e.calls.forEach(function (c) { parts.push(c.name); });
    e.turns.forEach(function (t) { t.completion.forEach(function (c) { parts.push(c[0]); }); });
    return parts.join(' ').toLowerCase();
  }
  function el(tag, cls, content) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (content !== undefined) { node.textContent = content; }
    return node;
  }
  function show(e, row) {
    Array.prototype.forEach.call(list.querySelectorAll('tr.on'), function (r) { r.className = ''; });
    if (row) { row.className = 'on'; }
    view.innerHTML = '';
    view.appendChild(el('h3', '', 'step ' + e.step + ', task ' + e.task + ', sample ' + e.sample));
    var adv = e.advantage === null || e.advantage === undefined ? '' :
      ', advantage ' + (Array.isArray(e.advantage) ? 'per turn ' + e.advantage.join(', ') : e.advantage);
    var facts = 'reward ' + e.reward + (e.success ? ' (success)' : '') + ', stop: ' + e.stop + adv;
    view.appendChild(el('p', e.success ? 'ok' : 'bad', facts));
    var comps = Object.keys(e.components || {}).map(function (k) { return k + ' ' + e.components[k]; });
    view.appendChild(el('p', '', 'reward components: ' + (comps.join(', ') || 'none')));
    if (e.error) { view.appendChild(el('p', 'bad', 'error: ' + e.error)); }
    var calls = el('ul', 'calls');
    e.calls.forEach(function (c) {
      calls.appendChild(el('li', c.ok ? 'ok' : 'bad', c.name + ' ' + JSON.stringify(c.arguments) +
        (c.ok ? '' : ' -> error: ' + c.error)));
    });
    view.appendChild(el('p', '', 'tool calls: ' + e.calls.length));
    view.appendChild(calls);
    e.turns.forEach(function (t, i) {
      var box = el('div', 'turn');
      box.appendChild(el('div', 'note', 'turn ' + (i + 1) + ' (finish: ' + t.finish + ')' +
        (t.cut ? ', ' + t.cut + ' earlier prompt tokens not shown' : '')));
      t.prompt.forEach(function (p) { box.appendChild(el('span', 'tok masked', p)); });
      t.completion.forEach(function (c) {
        var span = el('span', 'tok sampled', c[0]);
        span.title = 'log-prob ' + c[1] + ' (p = ' + Math.exp(c[1]).toFixed(3) + ')';
        box.appendChild(span);
      });
      view.appendChild(box);
    });
  }
  function render() {
    var step = fStep.value, min = parseFloat(fReward.value), needle = fText.value.toLowerCase();
    list.innerHTML = '';
    var head = el('tr');
    ['step', 'task', 'sample', 'reward', 'turns', 'calls', 'stop'].forEach(function (h) { head.appendChild(el('th', '', h)); });
    list.appendChild(head);
    var shown = 0;
    episodes.forEach(function (e) {
      if (step !== '' && String(e.step) !== step) { return; }
      if (!isNaN(min) && !(e.reward >= min)) { return; }
      if (needle && text(e).indexOf(needle) < 0) { return; }
      var row = el('tr');
      row.setAttribute('data-task', e.task);
      [e.step, e.task, e.sample, e.reward, e.turns.length, e.calls.length, e.stop].forEach(function (v) {
        row.appendChild(el('td', '', String(v)));
      });
      row.addEventListener('click', function () { show(e, row); });
      list.appendChild(row);
      shown += 1;
    });
    document.getElementById('f-count').textContent = shown + ' of ' + episodes.length + ' episodes';
  }
  [fStep, fReward, fText].forEach(function (node) { node.addEventListener('input', render); });
  fStep.addEventListener('change', render);
  render();
})();
"""
