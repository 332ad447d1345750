// The run form, generated from the run spec's schema (the page's form-config: every field's
// kind, default, bounds and help, from GET /api/runs/spec-schema/'s selector). The state is the
// spec's overrides (what differs from the defaults); the YAML view shows the same overrides and
// either side can be edited: each change is checked by POST /api/runs/spec-check/, which answers
// with the errors per field (the messages creating the run would give) and the other side's text.
// Untrusted text (help, errors) only ever goes into textContent.
(function () {
  const config = JSON.parse(document.getElementById("form-config").textContent);
  const form = document.getElementById("run-form");
  const yaml = document.getElementById("spec-yaml");
  const status = document.getElementById("spec-status");
  const generalErrors = document.getElementById("spec-errors");
  const submit = document.getElementById("create-button");
  const csrf = form.querySelector("input[name=csrfmiddlewaretoken]").value;
  const rows = new Map();  // dotted path -> {field, input, error}
  let overrides = {};
  let timer = null;
  let inFlight = null;
  let seq = 0;

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  const show = v => v === null || v === undefined ? "empty" : typeof v === "object" ? JSON.stringify(v) : String(v);

  // ---- nested overrides -------------------------------------------------------------------
  function getPath(tree, path) {
    return path.split(".").reduce((node, part) => node && typeof node === "object" ? node[part] : undefined, tree);
  }
  function setPath(tree, path, value) {
    const parts = path.split(".");
    let node = tree;
    for (const part of parts.slice(0, -1)) {
      if (typeof node[part] !== "object" || node[part] === null || Array.isArray(node[part])) node[part] = {};
      node = node[part];
    }
    node[parts[parts.length - 1]] = value;
  }
  function deletePath(tree, path) {
    const parts = path.split(".");
    const chain = [tree];
    for (const part of parts.slice(0, -1)) {
      const next = chain[chain.length - 1][part];
      if (typeof next !== "object" || next === null) return;
      chain.push(next);
    }
    delete chain[chain.length - 1][parts[parts.length - 1]];
    for (let i = chain.length - 1; i > 0; i--) {  // drop sections left empty
      if (Object.keys(chain[i]).length) break;
      delete chain[i - 1][parts[i - 1]];
    }
  }

  // ---- one input per field, by kind --------------------------------------------------------
  function makeInput(f, id) {
    let input;
    if (f.kind === "integer" || f.kind === "number") {
      input = el("input", {type: "number", id, step: f.kind === "integer" ? "1" : "any",
                           placeholder: show(f.default), inputmode: "decimal"});
      if (f.minimum !== undefined) input.min = f.minimum;
      if (f.maximum !== undefined) input.max = f.maximum;
    } else if (f.kind === "boolean" && !f.nullable) {
      input = el("input", {type: "checkbox", id});
    } else if (f.kind === "boolean" || f.kind === "choice") {
      input = el("select", {id});
      const choices = f.kind === "boolean" ? [true, false] : f.choices;
      if (f.nullable) input.append(el("option", {value: ""}, "(default: " + show(f.default) + ")"));
      for (const c of choices) input.append(el("option", {value: String(c)}, String(c)));
    } else if (f.kind === "mapping") {
      input = el("code", {id, class: "mapping"});
    } else {
      input = el("input", {type: "text", id, placeholder: f.kind === "list" ? "comma separated" : show(f.default)});
    }
    input.dataset.path = f.path;
    return input;
  }

  function readInput(f, input) {  // -> {set, value}
    if (input.type === "checkbox") return {set: true, value: input.checked};
    const raw = input.value.trim();
    if (raw === "") return {set: false};
    if (f.kind === "integer" || f.kind === "number") {
      const n = Number(raw);
      return {set: true, value: Number.isFinite(n) ? n : raw};  // the check names a bad number
    }
    if (f.kind === "boolean") return {set: true, value: raw === "true"};
    if (f.kind === "choice") return {set: true, value: f.choices.find(c => String(c) === raw) ?? raw};
    if (f.kind === "list") {
      const items = raw.split(",").map(x => x.trim()).filter(Boolean);
      return {set: true, value: items.map(x => f.item_kind === "integer" || f.item_kind === "number"
        ? (Number.isFinite(Number(x)) ? Number(x) : x) : x)};
    }
    return {set: true, value: input.value};
  }

  function writeInput(f, input, value) {
    if (input === document.activeElement) return;  // never fight the user's typing
    const v = value === undefined ? f.default : value;
    if (input.type === "checkbox") input.checked = Boolean(v);
    else if (f.kind === "mapping") input.textContent = show(v);
    else if (value === undefined || value === null) input.value = "";
    else if (f.kind === "list") input.value = Array.isArray(v) ? v.join(", ") : String(v);
    else input.value = String(v);
  }

  function fieldRow(f) {
    const id = "field-" + f.path.replace(/[^a-z0-9]+/gi, "-");
    const row = el("div", {class: "field", "data-path": f.path});
    const label = el("label", {for: id});
    label.append(el("span", {class: "label"}, f.label), " ", el("code", {}, f.path));
    const input = makeInput(f, id);
    const error = el("p", {class: "field-error", role: "alert"});
    row.append(label, input, el("span", {class: "default"}, "default " + show(f.default)));
    if (f.kind === "mapping") row.append(el("p", {class: "help"}, "edit this one in the YAML view"));
    if (f.description) row.append(el("p", {class: "help"}, f.description));
    row.append(error);
    const changed = () => {
      const {set, value} = readInput(f, input);
      if (!set || JSON.stringify(value) === JSON.stringify(f.default)) deletePath(overrides, f.path);
      else setPath(overrides, f.path, value);
      schedule({spec: overrides});
    };
    input.addEventListener("input", changed);
    input.addEventListener("change", changed);
    rows.set(f.path, {field: f, input, error, row});
    return row;
  }

  function build() {
    const common = document.getElementById("fields-common");
    common.replaceChildren();
    const more = document.getElementById("more-fields");
    const sections = new Map();
    for (const f of config.fields) {
      if (f.common) { common.append(fieldRow(f)); continue; }
      if (!sections.has(f.section)) {
        const box = el("details", {class: "card wide section", "data-section": f.section});
        box.append(el("summary", {}, f.section_title), el("div", {class: "fields"}));
        sections.set(f.section, box);
        more.append(box);
      }
      sections.get(f.section).querySelector(".fields").append(fieldRow(f));
    }
    for (const [section, box] of sections) {
      const count = [...rows.values()].filter(r => r.field.section === section).length;
      box.querySelector("summary").append(el("small", {}, ` ${count} settings`));
    }
  }

  function refreshInputs() {
    for (const {field, input} of rows.values()) writeInput(field, input, getPath(overrides, field.path));
  }

  // ---- errors ------------------------------------------------------------------------------
  function axisOf(field) {  // "axes[1].values[0]" (the service) or "sweep_values_2" (the form) -> 1
    const m = /^axes\[(\d+)\]/.exec(field || "") || /^sweep_(?:field|values)_(\d)$/.exec(field || "");
    if (!m) return null;
    return field.startsWith("axes") ? Number(m[1]) : Number(m[1]) - 1;
  }
  // The server's verdict on the submitted sweep (its values are not part of the spec the check
  // sees): kept next to the axes until the page is submitted again.
  const sweepErrors = (config.errors || []).filter(e => axisOf(e.field) !== null);
  function showErrors(checked) {
    const errors = [...checked, ...sweepErrors];
    for (const r of rows.values()) { r.error.textContent = ""; r.row.classList.remove("has-error"); r.input.removeAttribute("aria-invalid"); }
    for (const p of form.querySelectorAll(".axis .field-error")) p.textContent = "";
    generalErrors.replaceChildren();
    for (const e of errors) {
      const path = (e.field || "").replace(/^spec\./, "");
      const axis = axisOf(e.field);
      const r = rows.get(path) || (path ? [...rows.values()].find(x => path.startsWith(x.field.path + ".")) : null);
      if (r) {
        r.error.textContent = r.error.textContent ? r.error.textContent + "; " + e.message : e.message;
        r.row.classList.add("has-error");
        r.input.setAttribute("aria-invalid", "true");
        if (r.row.closest("details")) r.row.closest("details").open = true;
      } else if (axis !== null && form.querySelector(`.axis[data-axis="${axis}"] .field-error`)) {
        form.querySelector(`.axis[data-axis="${axis}"] .field-error`).textContent = e.message;
        document.getElementById("sweep").open = true;
      } else {
        const li = el("li");
        if (e.field) li.append(el("code", {}, e.field), ": ");
        li.append((e.line ? `line ${e.line}: ` : "") + e.message);
        generalErrors.append(li);
      }
    }
    const n = errors.length;
    status.textContent = n ? `${n} problem${n > 1 ? "s" : ""} to fix` : "spec is valid";
    status.className = "spec-status " + (n ? "bad" : "ok");
  }

  // ---- the check round trip ----------------------------------------------------------------
  // seq counts edits, not requests: an answer applies only if no edit came after the one it
  // checked. Counting requests let the page's first check, answered after the user had already
  // picked a preset but before that edit's own check went out, put the old overrides back.
  let pending = null;  // the payload of the scheduled check
  function schedule(payload) {
    clearTimeout(timer);
    status.textContent = "checking...";
    pending = payload;
    const mine = ++seq;
    timer = setTimeout(() => check(payload, mine), 250);
  }
  async function check(payload, mine) {
    timer = null;
    inFlight = fetch("/api/runs/spec-check/", {
      method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/json", "X-CSRFToken": csrf},
      body: JSON.stringify(payload)});
    let body;
    try {
      const resp = await inFlight;
      body = await resp.json();
      if (!resp.ok) body = {errors: body.errors || [{field: null, message: body.message}]};
    } catch (err) {
      body = {errors: [{field: null, message: "could not check the spec: " + err}]};
    } finally {
      inFlight = null;
    }
    if (mine !== seq) return;  // a newer edit is on its way: its answer will apply
    if ("yaml" in payload) {
      if (body.spec) { overrides = body.spec; refreshInputs(); }
    } else if (typeof body.yaml === "string" && document.activeElement !== yaml) {
      yaml.value = body.yaml;
    }
    showErrors(body.errors || []);
  }

  // ---- sweep: the button says what will be created ----------------------------------------
  function sweepCount() {
    let count = 0;
    for (const i of [1, 2]) {
      const field = form.querySelector(`[name=sweep_field_${i}]`).value;
      const values = form.querySelector(`[name=sweep_values_${i}]`).value.split(",").filter(v => v.trim());
      if (field && values.length) count = (count || 1) * values.length;
    }
    return count;
  }
  function updateSubmit() {
    const n = sweepCount();
    submit.textContent = n ? `Create sweep (${n} run${n > 1 ? "s" : ""})` : "Create run";
    const over = n > config.max_runs;
    submit.disabled = over;
    const first = form.querySelector('.axis[data-axis="0"] .field-error');
    if (over) first.textContent = `${n} combinations: a sweep holds at most ${config.max_runs} runs`;
    else if (first.textContent.includes("combinations:")) first.textContent = "";
  }
  for (const name of ["sweep_field_1", "sweep_values_1", "sweep_field_2", "sweep_values_2"]) {
    form.querySelector(`[name=${name}]`).addEventListener("input", updateSubmit);
  }

  // ---- wire up -----------------------------------------------------------------------------
  yaml.addEventListener("input", () => schedule({yaml: yaml.value}));
  form.addEventListener("submit", async ev => {
    if (!timer && !inFlight) return;  // the YAML view is current: it is what gets submitted
    ev.preventDefault();
    if (timer) {  // an edit not checked yet: check it now, so the YAML view is current
      clearTimeout(timer);
      await check(pending, seq);
    }
    while (inFlight) await inFlight.catch(() => null);
    HTMLFormElement.prototype.submit.call(form);  // not form.submit: an input may be named so
  });
  build();
  updateSubmit();
  schedule({yaml: yaml.value});  // fill the form from the YAML the page came with
})();
