// Charts draw downsampled series (min/max band + mean line) from the REST API and refresh while
// a run is live. The controls pick the x-axis (step, wall time, tokens consumed), smooth the
// lines (an exponential moving average, debiased as TensorBoard's) and, on the run page, which
// groups of charts show; they are remembered per page kind. Text from runs (names, events,
// samples) only ever goes into textContent.
(function () {
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                  "#7f7f7f", "#bcbd22", "#17becf"];
  const AXIS_TITLES = {step: "step", time: "wall time (s)", tokens: "tokens consumed"};

  async function getJSON(url) {
    const r = await fetch(url, {credentials: "same-origin"});
    if (!r.ok) throw new Error(url + " -> " + r.status);
    return r.json();
  }
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Plotly reads a few HTML-like tags in its texts (<b>, <a href>): user-given text (run names,
  // config values) goes in with its "<" escaped, so it shows as typed and never as markup.
  const plain = text => String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;");

  const fmt = {
    n: (v, d = 3) => v === null || v === undefined ? "–" : Number(v).toFixed(d),
    pct: v => v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%",
    s: v => v === null || v === undefined ? "–" : v < 120 ? v.toFixed(1) + " s" : (v / 60).toFixed(1) + " min",
    int: v => v === null || v === undefined ? "–" : Math.round(v).toLocaleString(),
  };

  // ---- controls ----------------------------------------------------------------------------
  function controls(kind, onChange) {
    const key = "oolong.charts." + kind;
    const saved = JSON.parse(localStorage.getItem(key) || "{}");
    const xAxis = document.getElementById("x-axis");
    const smoothing = document.getElementById("smoothing");
    const shown = document.getElementById("smoothing-value");
    const state = {x: saved.x || "step", smoothing: saved.smoothing || 0, hidden: saved.hidden || []};
    const save = () => localStorage.setItem(key, JSON.stringify(state));
    xAxis.value = state.x;
    smoothing.value = state.smoothing;
    shown.textContent = state.smoothing;
    xAxis.addEventListener("change", () => { state.x = xAxis.value; save(); onChange("x"); });
    smoothing.addEventListener("input", () => {
      state.smoothing = Number(smoothing.value); shown.textContent = smoothing.value; save(); onChange("smoothing");
    });
    for (const box of document.querySelectorAll("#chart-controls input[data-group]")) {
      const group = box.dataset.group;
      const section = document.querySelector(`.chart-group[data-group="${group}"]`);
      box.checked = !state.hidden.includes(group);
      section.hidden = !box.checked;
      box.addEventListener("change", () => {
        section.hidden = !box.checked;
        state.hidden = box.checked ? state.hidden.filter(g => g !== group) : [...state.hidden, group];
        save();
        if (box.checked) onChange("groups");
      });
    }
    return state;
  }
  function smooth(ys, weight) {
    if (!weight) return ys;
    let last = 0, n = 0;
    return ys.map(y => {
      if (y === null || y === undefined) return y;
      last = last * weight + (1 - weight) * y;
      n += 1;
      // 12 digits: a constant series stays exactly constant (plotly would zoom into the
      // rounding noise of the debiasing division).
      return Number((last / (1 - Math.pow(weight, n))).toPrecision(12));
    });
  }

  // ---- plotting ----------------------------------------------------------------------------
  function traces(series, label, color, state, extra) {
    const out = [];
    if (series.downsampled && !state.smoothing && !extra) {
      out.push({x: series.x, y: series.max, mode: "lines", line: {width: 0}, showlegend: false, hoverinfo: "skip"});
      out.push({x: series.x, y: series.min, mode: "lines", line: {width: 0}, fill: "tonexty",
                fillcolor: color + "33", showlegend: false, hoverinfo: "skip"});
    }
    if (state.smoothing) {  // the raw line stays, faint, under the smoothed one
      out.push({x: series.x, y: series.mean, mode: "lines", line: {color: color, width: 1},
                opacity: 0.25, showlegend: false, hoverinfo: "skip"});
    }
    out.push({x: series.x, y: smooth(series.mean, state.smoothing), mode: "lines", name: plain(label),
              line: {color: color, ...(extra || {})}});
    return out;
  }
  function ensureDiv(container, id) {
    let div = document.getElementById(id);
    if (!div) { div = el("div", {id, class: "chart"}); container.appendChild(div); }
    return div;
  }
  const layout = (title, empty, x) => empty
    ? {title: {text: title, font: {size: 13}}, xaxis: {visible: false}, yaxis: {visible: false},
       annotations: [{text: "no data yet", showarrow: false, font: {size: 14, color: "#889"}}]}
    : {title: {text: title, font: {size: 13}}, margin: {l: 50, r: 10, t: 30, b: 75},
       legend: {orientation: "h", x: 0, y: -0.22, yanchor: "top", font: {size: 11}},
       xaxis: {title: {text: AXIS_TITLES[x], font: {size: 11}, standoff: 2}}};
  const PLOT_CONFIG = {displayModeBar: false, responsive: true};

  // ---- evaluations (eval/<set>/<metric>, issue 48) ----------------------------------------
  const EVAL_TITLES = {greedy_accuracy: "greedy accuracy", "avg@k": "avg@k", "pass@k": "pass@k",
                       "maj@k": "maj@k"};
  // One eval curve: its 95% interval as a shaded band (the high end, then the low end filled up
  // to it) under the value's line; the hover names the weight version evaluated.
  function evalTraces(curve, label, color) {
    const hover = curve.step.map((s, i) => `step ${s} · version ` +
      (curve.version[i] === null ? "–" : "v" + curve.version[i]) +
      (curve.lo[i] === null ? "" : ` · 95% [${fmt.n(curve.lo[i])}, ${fmt.n(curve.hi[i])}]`));
    return [
      {x: curve.x, y: curve.hi, mode: "lines", line: {width: 0, color}, showlegend: false,
       hoverinfo: "skip", name: "95% interval (high)", meta: "band"},
      {x: curve.x, y: curve.lo, mode: "lines", line: {width: 0, color}, fill: "tonexty",
       fillcolor: color + "33", name: plain(label) + " 95% interval", showlegend: false,
       hoverinfo: "skip", meta: "band"},
      {x: curve.x, y: curve.value, mode: "lines+markers", name: plain(label), line: {color},
       text: hover, hovertemplate: "%{y:.3f}<br>%{text}<extra>" + plain(label) + "</extra>",
       meta: "value"},
    ];
  }
  async function drawEvals(cfg, state) {
    const box = document.getElementById("eval-charts");
    if (!box) return;
    const data = await getJSON(`/api/runs/${cfg.run_id}/evals/?buckets=${cfg.buckets}&x=${state.x}`);
    document.getElementById("eval-empty").hidden = data.curves.length > 0;
    data.curves.forEach((c, i) => {
      const title = `${c.set}: ${EVAL_TITLES[c.metric] || c.metric}`;
      const div = ensureDiv(box, `eval-${c.set}-${c.metric}`.replace(/[^A-Za-z0-9_-]/g, "_"));
      div.dataset.set = c.set;
      div.dataset.metric = c.metric;
      Plotly.react(div, evalTraces(c, c.metric, COLORS[i % COLORS.length]),
                   {...layout(plain(title), false, state.x), yaxis: {rangemode: "tozero"}},
                   PLOT_CONFIG);
    });
  }

  // ---- the run page ------------------------------------------------------------------------
  async function drawRun(cfg, state) {
    const visible = cfg.groups.filter(g => !state.hidden.includes(g.id));
    const keys = [...new Set(visible.flatMap(g => g.charts.flatMap(c => c[1])))];
    if (!keys.length) return;
    const data = await getJSON(`/api/runs/${cfg.run_id}/metrics/?keys=${encodeURIComponent(keys.join(","))}&buckets=${cfg.buckets}&x=${state.x}`);
    const byKey = Object.fromEntries(data.series.map(s => [s.key, s]));
    for (const group of visible) {
      const container = document.getElementById("charts-" + group.id);
      group.charts.forEach(([title, ks], i) => {
        const t = ks.filter(k => byKey[k] && byKey[k].step.length)
                    .flatMap((k, j) => traces(byKey[k], k, COLORS[j % COLORS.length], state));
        Plotly.react(ensureDiv(container, `chart-${group.id}-${i}`), t, layout(title, !t.length, state.x), PLOT_CONFIG);
      });
    }
  }
  async function drawTrajectories(runId, step) {
    const box = document.getElementById("trajectories");
    const samples = await getJSON(`/api/runs/${runId}/trajectories/` + (step ? `?step=${step}` : ""));
    if (!samples.length) return;
    const maxV = Math.max(1, ...samples.flatMap(s => s.token_versions));
    box.replaceChildren();
    for (const s of samples) {
      const d = el("div", {class: "sample"});
      d.appendChild(el("div", {}, `reward ${s.reward.toFixed(3)} · prompt: ${s.prompt}`));
      const info = s.info || {};
      if (info.extract) {  // what the reward scored: the answer its extractor found
        d.appendChild(el("div", {class: "extracted"}, `answer (extract ${info.extract}): ` +
          (info.extracted == null ? "none found" : info.extracted) +
          (info.dropped_stale ? " · dropped from the loss (too stale)" : "")));
      }
      if (Array.isArray(info.turns) && info.turns.length) d.appendChild(conversation(info.turns));
      s.tokens.forEach((tok, i) => {
        const span = el("span", {class: "tok"}, tok);
        const v = s.token_versions[i] ?? 0;
        span.style.background = `hsl(${200 - 160 * v / maxV}, 70%, 85%)`;
        span.title = "version " + v;
        d.appendChild(span);
      });
      box.appendChild(d);
    }
  }
  // An agent's segment turn by turn (gateway/credit.py): the messages the agent added (user
  // turns, tool results), what the model answered, its tool calls, the turn's return and the
  // policy versions its tokens came from. Text only (textContent): it is the agent's output.
  function conversation(turns) {
    const ol = el("ol", {class: "turns"});
    for (const t of turns) {
      const li = el("li", {class: "turn"});
      const versions = (t.versions || []).join(", ");
      li.appendChild(el("div", {class: "turn-head"}, `turn ${t.turn} · return ` +
        `${Number(t.return ?? 0).toFixed(3)} · versions ${versions || "-"} · ${t.finish_reason}` +
        (t.tool_parse_failed ? " · tool call not parsed" : "")));
      for (const m of t.new_messages || []) {
        const who = m.role === "tool" ? "tool result" + (m.tool_call_id ? ` (${m.tool_call_id})` : "") : m.role;
        const text = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
        li.appendChild(el("div", {class: "msg " + m.role}, `${who}: ${text}`));
      }
      li.appendChild(el("div", {class: "msg assistant"}, `assistant: ${t.completion}`));
      for (const call of t.tool_calls || []) {
        const f = call.function || {};
        li.appendChild(el("div", {class: "msg tool-call"}, `→ ${f.name}(${f.arguments})`));
      }
      ol.appendChild(li);
    }
    return ol;
  }
  async function refreshEvents(runId) {
    const events = await getJSON(`/api/runs/${runId}/events/`);
    const ol = document.getElementById("events");
    ol.replaceChildren(...events.slice().reverse().map(e => {
      const li = el("li");
      li.append(el("time", {}, e.time.slice(11, 19)), " ", el("b", {}, e.kind), " ", e.message);
      return li;
    }));
  }

  // ---- comparisons (the compare page and a sweep's page) -----------------------------------
  function summaryTable(summary, focus) {
    document.getElementById("target-label").textContent = summary.target === null ? "–" : summary.target.toFixed(3);
    const rows = summary.rows;
    const best = (key, better) => {
      const vals = rows.map(r => r[key]).filter(v => v !== null && v !== undefined);
      return vals.length ? (better === "max" ? Math.max(...vals) : Math.min(...vals)) : null;
    };
    const bests = {final_reward: best("final_reward", "max"), final_eval: best("final_eval", "max"),
                   best_eval: best("best_eval", "max"), time_to_target_s: best("time_to_target_s", "min"),
                   tokens_per_s: best("tokens_per_s", "max")};
    const body = document.querySelector("#summary tbody");
    body.replaceChildren(...rows.map(r => {
      const tr = el("tr", {"data-run": String(r.run_id)});
      if (r.run_id === focus) tr.className = "focus";
      const link = el("a", {href: `/runs/${r.run_id}/`}, r.name);
      const cells = [
        [link], [el("span", {class: "status " + r.status}, r.status)], [fmt.int(r.steps)], [fmt.s(r.wall_s)],
        [fmt.n(r.final_reward), "final_reward"], [fmt.pct(r.final_eval), "final_eval"],
        [r.best_eval === null ? "–" : `${fmt.pct(r.best_eval)} (${r.best_eval_step})`, "best_eval"],
        [r.time_to_target_s === null ? "–" : `${fmt.s(r.time_to_target_s)} (step ${r.step_to_target})`, "time_to_target_s"],
        [fmt.int(r.tokens_per_s), "tokens_per_s"]];
      cells.forEach(([content, key], i) => {
        const td = el("td", {class: i >= 2 ? "num" : ""});
        if (typeof content === "string") td.textContent = content; else td.append(content);
        if (key && rows.length > 1 && r[key] !== null && r[key] === bests[key]) td.classList.add("best");
        tr.append(td);
      });
      return tr;
    }));
  }
  function parcoords(data) {
    const box = document.getElementById("parcoords");
    if (!box) return;
    const runs = data.runs;
    const rows = Object.fromEntries(data.summary.rows.map(r => [r.run_id, r]));
    const dims = [];
    for (const row of data.config_diff.filter(r => r.differs)) {
      const values = row.values;
      if (values.every(v => typeof v === "number")) {
        dims.push({label: plain(row.key), values});
      } else {  // categories: indices with their names as ticks
        const cats = [...new Set(values.map(v => JSON.stringify(v)))];
        dims.push({label: plain(row.key), values: values.map(v => cats.indexOf(JSON.stringify(v))),
                   tickvals: cats.map((_, i) => i), ticktext: cats.map(c => c.replace(/^"|"$/g, ""))});
      }
    }
    const outcome = (label, key) => {
      const values = runs.map(r => rows[r.id][key]);
      if (values.some(v => v !== null && v !== undefined)) dims.push({label, values: values.map(v => v ?? NaN)});
    };
    outcome("final reward", "final_reward");
    outcome("best eval", "best_eval");
    outcome("tokens/s", "tokens_per_s");
    outcome("time to target (s)", "time_to_target_s");
    if (dims.length < 2) {
      box.replaceChildren(el("p", {class: "help"}, "Parallel coordinates need at least two differing fields or outcomes."));
      return;
    }
    const color = runs.map(r => rows[r.id].final_reward ?? 0);
    Plotly.react(box, [{type: "parcoords", dimensions: dims,
                        line: {color, colorscale: "Viridis", showscale: true, colorbar: {title: {text: "final reward"}}}}],
                 {margin: {l: 60, r: 60, t: 40, b: 20}}, PLOT_CONFIG);
  }
  // The comparison's evaluation: one eval set's metric per run with its band, and when each
  // run first reached the target accuracy (interpolated between the evaluations around it).
  async function drawEvalCompare(cfg, state) {
    const box = document.getElementById("eval-compare-chart");
    if (!box) return;
    const setSel = document.getElementById("eval-set"), metricSel = document.getElementById("eval-metric");
    const target = document.getElementById("eval-target").value.trim();
    const q = `ids=${cfg.run_ids.join(",")}&buckets=${cfg.buckets}&x=${state.x}` +
              (setSel.value ? `&set=${encodeURIComponent(setSel.value)}` : "") +
              `&metric=${encodeURIComponent(metricSel.value || "greedy_accuracy")}` +
              (target !== "" ? `&target=${encodeURIComponent(target)}` : "");
    const data = await getJSON(`/api/runs/compare/evals/?${q}`);
    const sets = Object.keys(data.sets);
    setSel.replaceChildren(...sets.map(name => el("option", {value: name}, name)));
    setSel.value = data.set;
    const metrics = data.sets[data.set] || ["greedy_accuracy"];
    metricSel.replaceChildren(...metrics.map(m => el("option", {value: m}, EVAL_TITLES[m] || m)));
    metricSel.value = metrics.includes(data.metric) ? data.metric : metrics[0];
    document.getElementById("eval-target-label").textContent = data.target === null ? "–" : fmt.pct(data.target);
    const t = [];
    cfg.run_ids.forEach((id, ri) => {
      const curve = data.series[id];
      const row = data.rows.find(r => r.run_id === id);
      if (curve && curve.step.length) t.push(...evalTraces(curve, row.name, COLORS[ri % COLORS.length]));
    });
    const title = `${data.set}: ${EVAL_TITLES[data.metric] || data.metric}`;
    Plotly.react(box, t, {...layout(plain(title), !t.length, state.x), showlegend: true}, PLOT_CONFIG);
    const body = document.querySelector("#eval-summary tbody");
    body.replaceChildren(...data.rows.map(r => {
      const tr = el("tr", {"data-run": String(r.run_id)});
      const ci = r.final_ci && r.final_ci[0] !== null ? ` [${fmt.pct(r.final_ci[0])}, ${fmt.pct(r.final_ci[1])}]` : "";
      const cells = [r.name, String(r.evals), r.final === null ? "–" : fmt.pct(r.final) + ci];
      if (!r.evals) cells.push("no evaluation yet", "", "");
      else if (!r.reached) cells.push("not reached", "", "");
      else cells.push(r.minutes_to_target.toFixed(2) + " min", r.step_to_target.toFixed(1),
                      fmt.int(r.tokens_to_target));
      cells.forEach((text, i) => tr.append(el("td", {class: i ? "num" : ""}, text)));
      return tr;
    }));
    return data;
  }
  async function drawCompare(cfg, state, target) {
    const keys = [...new Set(cfg.charts.flatMap(c => c[1]))];
    const q = `ids=${cfg.run_ids.join(",")}&keys=${encodeURIComponent(keys.join(","))}&buckets=${cfg.buckets}&x=${state.x}` +
              (target !== "" ? `&target=${encodeURIComponent(target)}` : "");
    const data = await getJSON(`/api/runs/compare/?${q}`);
    const names = Object.fromEntries(data.runs.map(r => [r.id, r.name]));
    const container = document.getElementById("charts");
    cfg.charts.forEach(([title, ks], i) => {
      const t = [];
      cfg.run_ids.forEach((id, ri) => {
        const byKey = Object.fromEntries(data.series[id].map(s => [s.key, s]));
        ks.forEach(k => {
          if (byKey[k] && byKey[k].step.length) {
            const extra = cfg.focus === null || cfg.focus === undefined ? {}
              : id === cfg.focus ? {width: 3} : {width: 1.2, dash: "dot"};
            t.push(...traces(byKey[k], names[id], COLORS[ri % COLORS.length], state, extra));
          }
        });
      });
      Plotly.react(ensureDiv(container, "chart-" + i), t, layout(title, !t.length, state.x), PLOT_CONFIG);
    });
    summaryTable(data.summary, cfg.focus);
    parcoords(data);
    return data;
  }

  window.oolong = {
    runPage(cfg) {
      const sel = document.getElementById("traj-step");
      let state;
      const tick = async () => {
        await drawRun(cfg, state);
        await drawEvals(cfg, state);
        await drawTrajectories(cfg.run_id, sel && sel.value);
        const run = await getJSON(`/api/runs/${cfg.run_id}/`);
        const badge = document.getElementById("run-status");
        badge.textContent = run.status;
        badge.className = "status " + run.status;
        if (cfg.live) await refreshEvents(cfg.run_id);
        return run;
      };
      state = controls("run", () => { drawRun(cfg, state); drawEvals(cfg, state); });
      if (sel) sel.addEventListener("change", () => drawTrajectories(cfg.run_id, sel.value));
      tick().then(run => {
        if (!cfg.live) return;
        const timer = setInterval(async () => {
          const r = await tick();
          if (["succeeded", "failed", "cancelled"].includes(r.status)) clearInterval(timer);
        }, 3000);
      });
    },
    comparePage(cfg) {
      const target = document.getElementById("target");
      let state;
      const draw = () => drawCompare(cfg, state, target.value.trim());
      const drawEvalsNow = () => drawEvalCompare(cfg, state);
      state = controls("compare", () => { draw(); drawEvalsNow(); });
      target.addEventListener("change", draw);
      for (const id of ["eval-set", "eval-metric", "eval-target"]) {
        const input = document.getElementById(id);
        if (input) input.addEventListener("change", drawEvalsNow);
      }
      draw();
      drawEvalsNow();
      const onlyDiff = document.getElementById("only-diff");
      if (onlyDiff) onlyDiff.addEventListener("change", e =>
        document.getElementById("diff-table").classList.toggle("only-diff", e.target.checked));
    },
  };
  // Pages hand their settings over as JSON data (json_script), never as inline script: the
  // Content-Security-Policy allows scripts from our own origin only.
  document.addEventListener("DOMContentLoaded", () => {
    const config = document.getElementById("page-config");
    if (!config) return;
    const page = JSON.parse(config.textContent);
    if (page.page === "run") window.oolong.runPage(page);
    if (page.page === "compare") window.oolong.comparePage(page);
  });
})();
