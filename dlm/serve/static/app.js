// dlm playground: one prompt, raced by every chosen model over the server's own streaming API.
// Each panel reads OpenAI-format chunks (POST /v1/completions, stream: true, dlm_stream_steps: true):
//   choices[0].text  text that became final (AR: one token; diffusion: a committed block; speculation: a cycle)
//   dlm.event=step   a denoising step: the canvas (token pieces, null = <mask>) and which positions are fixed
//   dlm.event=draft  a verify cycle: the proposed tokens, how many were accepted (the text that follows holds them)
//   dlm.event=stats  the last chunk: tokens/s, tokens per forward, tau, forwards, steps, ttft
"use strict";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
let served = [];
let auth = false;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value;
  if (auth && key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function loadModels() {
  try {
    const health = await (await fetch("/health")).json();
    auth = !!health.auth;
    $("keybox").hidden = !auth;
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error((await r.json()).error.message);
    served = (await r.json()).data;
  } catch (e) {
    $("models").innerHTML = "";
    $("models").append(el("span", "muted", "could not list models: " + e.message));
    return;
  }
  const want = params.get("models") ? params.get("models").split(",") : null;
  const box = $("models");
  box.innerHTML = "";
  box.append(el("legend", "", "Models"));
  for (const m of served) {
    const lab = el("label");
    const cb = el("input");
    cb.type = "checkbox";
    cb.value = m.id;
    cb.checked = want ? want.includes(m.id) : true;
    lab.append(cb, document.createTextNode(m.id + " "), el("span", "badge " + m.dlm.paradigm, m.dlm.paradigm));
    box.append(lab);
  }
}

// one racer ---------------------------------------------------------------------------------------------

class Panel {
  constructor(model, prompt, suffix) {
    this.model = model;
    this.paradigm = model.dlm.paradigm;
    this.root = el("div", "panel");
    const h = el("h2");
    h.append(el("span", "", model.id), el("span", "badge " + this.paradigm, this.paradigm));
    this.place = el("span", "place", "");
    h.append(this.place);
    this.bar = el("div", "bar");
    this.out = el("pre", "out");
    this.meta = el("div", "meta");
    this.root.append(h, this.bar, this.out, this.meta);
    this.out.append(el("span", "prompt", prompt));
    this.text = el("span", "text");  // final text
    this.canvas = el("span", "canvas");  // the canvas being denoised
    this.suffix = el("span", "pin", suffix || "");
    this.out.append(this.text, this.canvas, this.suffix);
    this.tokens = 0;  // tokens so far (live estimate; exact when the stats arrive)
    this.committed = 0;
    this.lastCanvas = 0;
    this.cycles = 0;
    this.accepted = 0;
    this.t0 = performance.now();
    this.stats = null;
    this.showMeta();
  }

  elapsed() { return ((this.t1 || performance.now()) - this.t0) / 1000; }

  showMeta(maxTokens) {
    const s = this.stats;
    const secs = s ? s.seconds : this.elapsed();
    const tps = s ? s.tokens_per_second : (secs > 0 ? this.tokens / secs : 0);
    const parts = [["tok/s", tps.toFixed(1)], ["tokens", s ? s.new_tokens : this.tokens]];
    if (s) parts.push(["tok/fwd", s.tokens_per_forward.toFixed(2)], ["forwards", s.forwards]);
    else if (this.tokens) parts.push(["tok/fwd", "~" + this.liveTPF().toFixed(2)]);
    if (this.paradigm === "speculative") {
      const tau = s && s.tau !== undefined ? s.tau : (this.cycles ? (this.accepted + this.cycles) / this.cycles : 0);
      parts.push(["tau", tau.toFixed(2)]);
    }
    if (s && s.steps !== undefined) parts.push(["steps", s.steps], ["canvases", s.canvases]);
    if (s && s.ttft !== null && s.ttft !== undefined) parts.push(["TTFT", s.ttft.toFixed(3) + " s"]);
    parts.push(["time", secs.toFixed(2) + " s"]);
    this.meta.innerHTML = "";
    for (const [k, v] of parts) {
      const span = el("span", "", k + " ");
      span.append(el("b", "", String(v)));
      this.meta.append(span);
    }
    if (maxTokens) this.bar.style.width = Math.min(100, 100 * this.tokens / maxTokens) + "%";
  }

  liveTPF() {  // forwards so far, as the events tell them (the exact count arrives with the stats)
    if (this.paradigm === "speculative") return this.tokens / (this.cycles + 1);
    if (this.paradigm === "mdlm" || this.paradigm === "usdm") return this.tokens / Math.max(1, this.stepsSeen || 0);
    return 1;
  }

  step(d) {
    // the canvas after one denoising step: fixed tokens green, noise (usdm) dim red, masks as blocks
    this.canvas.innerHTML = "";
    let fixed = 0;
    d.tokens.forEach((t, i) => {
      if (t === null) { this.canvas.append(el("span", "mask", "░")); return; }
      if (d.fixed[i]) { fixed++; this.canvas.append(el("span", "fixed", t)); }
      else this.canvas.append(el("span", "noisy", t));
    });
    this.lastCanvas = d.tokens.length;
    this.tokens = this.committed + fixed;
    this.stepsSeen = (this.stepsSeen || 0) + 1;
  }

  append(text, d) {
    if (this.paradigm === "mdlm" || this.paradigm === "usdm") {
      this.canvas.innerHTML = "";  // the block became final text
      this.committed += this.lastCanvas || 0;
      this.tokens = this.committed;
      this.lastCanvas = 0;
      if (text) this.text.append(el("span", "fixed", text));
      return;
    }
    if (d && d.event === "draft") {
      this.cycles++;
      this.accepted += d.accepted;
      this.tokens += d.accepted + 1;
      const n = Math.min(d.accepted_text.length, text.length);
      if (n) this.text.append(el("span", "acc", text.slice(0, n)));
      if (text.length > n) this.text.append(el("span", "tok", text.slice(n)));
      if (d.rejected_text) {  // shown, not part of the text: one line, newlines as ⏎, at most 16 characters
        let r = d.rejected_text.replace(/\n/g, "⏎");
        if (r.length > 16) r = r.slice(0, 15) + "…";
        this.text.append(el("span", "rej", r));
      }
      return;
    }
    if (text) {
      this.tokens++;
      this.text.append(el("span", "tok", text));
    }
  }

  fail(msg) {
    this.root.classList.add("error");
    this.canvas.innerHTML = "";
    this.text.append(el("span", "", "\n[" + msg + "]"));
  }
}

async function runPanel(panel, body, maxTokens) {
  let res;
  try {
    res = await fetch("/v1/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  } catch (e) {
    panel.fail("request failed: " + e.message);
    panel.t1 = performance.now();
    return;
  }
  if (!res.ok) {
    let msg = res.status + "";
    try { msg += ": " + (await res.json()).error.message; } catch (e) { /* not JSON */ }
    panel.fail(msg);
    panel.t1 = performance.now();
    return;
  }
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  const timer = setInterval(() => panel.showMeta(maxTokens), 100);
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const msg = JSON.parse(data);
        if (msg.error) { panel.fail(msg.error.message); continue; }
        const d = msg.dlm;
        if (d && d.event === "step") { panel.step(d); continue; }
        const text = msg.choices && msg.choices.length ? msg.choices[0].text : "";
        panel.append(text || "", d);
        if (d && d.event === "stats") { panel.stats = d; panel.tokens = d.new_tokens; }
      }
    }
  } catch (e) {
    panel.fail("stream broken: " + e.message);
  } finally {
    clearInterval(timer);
    panel.t1 = performance.now();
    panel.root.classList.add("done");
    panel.bar.style.width = "100%";
    panel.showMeta(maxTokens);
  }
}

async function race() {
  const chosen = [...document.querySelectorAll("#models input:checked")].map((c) => c.value);
  const models = served.filter((m) => chosen.includes(m.id));
  if (!models.length) { $("status").textContent = "choose at least one model"; return; }
  const prompt = $("prompt").value;
  const suffix = $("suffix").value;
  const maxTokens = parseInt($("max_tokens").value, 10) || 48;
  const temperature = parseFloat($("temperature").value) || 0;
  const seed = parseInt($("seed").value, 10) || 0;
  $("race").disabled = true;
  document.body.dataset.state = "racing";
  $("status").textContent = "racing " + models.length + " models…";
  const box = $("panels");
  box.innerHTML = "";
  box.classList.toggle("hide-rej", !$("show_rejected").checked);
  const finished = [];
  const runs = models.map((m) => {
    const panel = new Panel(m, prompt, suffix);
    box.append(panel.root);
    // temperature is always sent (the API's default is OpenAI's 1); a usdm model scales its t_max -> t_min
    // schedule by it (0 and 1: the schedule as it is)
    const body = { model: m.id, prompt, max_tokens: maxTokens, stream: true, dlm_stream_steps: true, seed, temperature };
    if (suffix) body.suffix = suffix;
    return runPanel(panel, body, maxTokens).then(() => {
      if (!panel.root.classList.contains("error")) finished.push(panel);
      const place = finished.indexOf(panel);
      if (place >= 0) {
        panel.place.textContent = ["1st", "2nd", "3rd"][place] || (place + 1) + "th";
        if (place === 0) panel.place.classList.add("first");
      }
    });
  });
  await Promise.all(runs);
  $("race").disabled = false;
  $("status").textContent = "done: " + finished.map((p) => p.model.id + " " + p.elapsed().toFixed(2) + " s").join(" · ");
  document.body.dataset.state = "done";
}

$("race").addEventListener("click", race);
$("show_rejected").addEventListener("change", () =>
  $("panels").classList.toggle("hide-rej", !$("show_rejected").checked));

(async () => {
  for (const k of ["prompt", "suffix", "max_tokens", "temperature", "seed"]) {
    if (params.has(k)) $(k).value = params.get(k);
  }
  await loadModels();
  if (params.get("race")) race();
})();
