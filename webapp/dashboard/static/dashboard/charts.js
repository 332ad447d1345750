// Charts draw downsampled series (min/max band + mean line) from the REST API and refresh while
// a run is live.
(function () {
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
  async function getJSON(url) {
    const r = await fetch(url, {credentials: "same-origin"});
    if (!r.ok) throw new Error(url + " -> " + r.status);
    return r.json();
  }
  function traces(series, label, color, dash) {
    const out = [];
    if (series.downsampled) {
      out.push({x: series.step, y: series.max, mode: "lines", line: {width: 0}, showlegend: false, hoverinfo: "skip"});
      out.push({x: series.step, y: series.min, mode: "lines", line: {width: 0}, fill: "tonexty",
                fillcolor: color + "33", showlegend: false, hoverinfo: "skip"});
    }
    out.push({x: series.step, y: series.mean, mode: "lines", name: label, line: {color: color, dash: dash}});
    return out;
  }
  function ensureDiv(container, id) {
    let div = document.getElementById(id);
    if (!div) { div = document.createElement("div"); div.id = id; div.className = "chart"; container.appendChild(div); }
    return div;
  }
  const layout = (title, empty) => empty
    ? {title: {text: title, font: {size: 13}}, xaxis: {visible: false}, yaxis: {visible: false},
       annotations: [{text: "no data yet", showarrow: false, font: {size: 14, color: "#889"}}]}
    : {title: {text: title, font: {size: 13}}, margin: {l: 45, r: 10, t: 30, b: 30},
       legend: {orientation: "h", y: -0.2}, xaxis: {title: "step"}};
  async function drawRun(runId, charts, container) {
    const keys = [...new Set(charts.flatMap(c => c[1]))];
    const data = await getJSON(`/api/runs/${runId}/metrics/?keys=${encodeURIComponent(keys.join(","))}&buckets=400`);
    const byKey = Object.fromEntries(data.series.map(s => [s.key, s]));
    charts.forEach(([title, ks], i) => {
      const t = ks.filter(k => byKey[k] && byKey[k].step.length)
                  .flatMap((k, j) => traces(byKey[k], k, COLORS[j % COLORS.length]));
      Plotly.react(ensureDiv(container, "chart-" + i), t, layout(title, !t.length), {displayModeBar: false, responsive: true});
    });
  }
  async function drawTrajectories(runId, step) {
    const box = document.getElementById("trajectories");
    const samples = await getJSON(`/api/runs/${runId}/trajectories/` + (step ? `?step=${step}` : ""));
    if (!samples.length) return;
    const maxV = Math.max(1, ...samples.flatMap(s => s.token_versions));
    box.innerHTML = "";
    for (const s of samples) {
      const d = document.createElement("div"); d.className = "sample";
      const head = document.createElement("div");
      head.textContent = `reward ${s.reward.toFixed(3)} · prompt: ${s.prompt}`;
      d.appendChild(head);
      const info = s.info || {};
      if (info.extract) {  // what the reward scored: the answer its extractor found
        const ans = document.createElement("div"); ans.className = "extracted";
        ans.textContent = `answer (extract ${info.extract}): ` +
          (info.extracted == null ? "none found" : info.extracted) +
          (info.dropped_stale ? " · dropped from the loss (too stale)" : "");
        d.appendChild(ans);
      }
      s.tokens.forEach((tok, i) => {
        const span = document.createElement("span"); span.className = "tok"; span.textContent = tok;
        const v = s.token_versions[i] ?? 0;
        span.style.background = `hsl(${200 - 160 * v / maxV}, 70%, 85%)`; span.title = "version " + v;
        d.appendChild(span);
      });
      box.appendChild(d);
    }
  }
  async function refreshEvents(runId) {
    const events = await getJSON(`/api/runs/${runId}/events/`);
    const ol = document.getElementById("events");
    // Event text comes from run processes: build nodes with textContent, never HTML strings.
    ol.replaceChildren(...events.slice().reverse().map(e => {
      const li = document.createElement("li");
      const time = document.createElement("time"); time.textContent = e.time.slice(11, 19);
      const kind = document.createElement("b"); kind.textContent = e.kind;
      li.append(time, " ", kind, " ", e.message);
      return li;
    }));
  }
  window.oolong = {
    runPage(runId, charts, live) {
      const container = document.getElementById("charts");
      const sel = document.getElementById("traj-step");
      const tick = async () => {
        await drawRun(runId, charts, container);
        await drawTrajectories(runId, sel && sel.value);
        const run = await getJSON(`/api/runs/${runId}/`);
        document.getElementById("run-status").textContent = run.status;
        document.getElementById("run-status").className = "status " + run.status;
        if (live) await refreshEvents(runId);
        return run;
      };
      if (sel) sel.addEventListener("change", () => drawTrajectories(runId, sel.value));
      tick().then(run => {
        if (!live) return;
        const timer = setInterval(async () => {
          const r = await tick();
          if (["succeeded", "failed", "cancelled"].includes(r.status)) clearInterval(timer);
        }, 3000);
      });
    },
    async comparePage(runIds, charts) {
      const container = document.getElementById("charts");
      const keys = [...new Set(charts.flatMap(c => c[1]))];
      const data = await getJSON(`/api/runs/compare/?ids=${runIds.join(",")}&keys=${encodeURIComponent(keys.join(","))}&buckets=300`);
      const names = Object.fromEntries(data.runs.map(r => [r.id, r.name]));
      charts.forEach(([title, ks], i) => {
        const t = [];
        runIds.forEach((id, ri) => {
          const byKey = Object.fromEntries(data.series[id].map(s => [s.key, s]));
          ks.forEach((k, ki) => {
            if (byKey[k] && byKey[k].step.length)
              t.push({x: byKey[k].step, y: byKey[k].mean, mode: "lines", name: `${names[id]} ${k}`,
                      line: {color: COLORS[ri % COLORS.length], dash: ["solid", "dot", "dash"][ki % 3]}});
          });
        });
        Plotly.react(ensureDiv(container, "chart-" + i), t, layout(title, !t.length), {displayModeBar: false, responsive: true});
      });
      const onlyDiff = document.getElementById("only-diff");
      onlyDiff.addEventListener("change", e =>
        document.getElementById("diff-table").classList.toggle("only-diff", e.target.checked));
    },
  };
  // Pages hand their settings over as JSON data (json_script), never as inline script: the
  // Content-Security-Policy allows scripts from our own origin only.
  document.addEventListener("DOMContentLoaded", () => {
    const config = document.getElementById("page-config");
    if (!config) return;
    const page = JSON.parse(config.textContent);
    if (page.page === "run") window.oolong.runPage(page.run_id, page.charts, page.live);
    if (page.page === "compare") window.oolong.comparePage(page.run_ids, page.charts);
  });
})();
