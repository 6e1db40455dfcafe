// sdpa view: the page. Asks the local server for one row at a time (GET /row), so it
// never holds an n x n matrix; a static export (window.SDPA_DATA) answers from the
// dense weights embedded in the file instead. No external request of any kind.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const state = { info: null, layer: 0, head: 0, query: null, values: null, busy: 0 };

  // ---- where the numbers come from: the server, or the weights embedded in the file
  const embedded = window.SDPA_DATA || null;
  const decoded = new Map();

  function floats(b64) {
    const bin = atob(b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return new Float32Array(bytes.buffer);
  }

  async function getJSON(url) {
    const r = await fetch(url, { cache: "no-store" });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error || r.statusText);
    return body;
  }

  const source = embedded ? {
    info: async () => embedded.info,
    grid: async () => embedded.info,
    row: async (layer, head, query) => {
      if (!decoded.has(layer)) decoded.set(layer, floats(embedded.weights[layer]));
      const w = decoded.get(layer), n = embedded.info.length, H = embedded.info.heads[layer];
      if (head !== "mean") return Array.from(w.subarray((head * n + query) * n, (head * n + query + 1) * n));
      const out = new Array(n).fill(0);
      for (let h = 0; h < H; h++) {
        const base = (h * n + query) * n;
        for (let j = 0; j < n; j++) out[j] += w[base + j];
      }
      return out.map((x) => x / H);
    },
    head: async (layer, head) => embedded.stats[layer][head === "mean" ? embedded.info.heads[layer] : head],
  } : {
    info: () => getJSON("info"),
    grid: () => getJSON("grid"),
    row: async (layer, head, query) =>
      (await getJSON(`row?layer=${layer}&head=${head}&query=${query}`)).weights,
    head: (layer, head) => getJSON(`head?layer=${layer}&head=${head}`),
  };

  // ---- colours
  function heat(t) {  // 0..1 -> a white-to-red ramp (text) as rgb
    const a = Math.max(0, Math.min(1, t));
    return `rgba(214, 52, 30, ${(0.04 + 0.86 * a).toFixed(3)})`;
  }
  function ramp(t) {  // 0..1 -> dark blue .. yellow (pixel maps), [r, g, b]
    const a = Math.max(0, Math.min(1, t));
    return [Math.round(30 + 225 * a ** 0.8), Math.round(20 + 210 * a), Math.round(90 + 60 * (1 - a) - 40 * a)];
  }
  const fmt = (x) => (x === undefined ? "" : Number(x).toPrecision(6));
  const headName = (h) => (h === "mean" ? "head average" : `head ${h}`);
  const tokenLabel = (i) => `${JSON.stringify(state.info.tokens[i])} (#${i})`;

  // ---- the layer x head grid: cells first, their summaries as each layer's are done
  function buildGrid() {
    const info = state.info, maxH = Math.max(...info.heads);
    const table = document.createElement("table");
    const head = table.createTHead().insertRow();
    head.insertCell().outerHTML = "<th></th>";
    for (let h = 0; h < maxH; h++) head.insertCell().outerHTML = `<th>${h}</th>`;
    head.insertCell().outerHTML = "<th>mean</th>";
    const body = table.createTBody();
    info.heads.forEach((count, layer) => {
      const row = body.insertRow();
      row.insertCell().outerHTML = `<th>L${layer}</th>`;
      for (let h = 0; h < count; h++) row.insertCell().appendChild(cell(layer, h));
      for (let h = count; h < maxH; h++) row.insertCell();
      const b = cell(layer, "mean");
      b.classList.add("mean");
      b.textContent = "mean";
      row.insertCell().appendChild(b);
    });
    $("grid").replaceChildren(table);
    paintGrid(info.grid);
  }

  function cell(layer, head) {
    const b = document.createElement("button");
    b.dataset.layer = layer;
    b.dataset.head = head;
    if (head !== "mean") b.textContent = head;
    b.title = `layer ${layer}, ${headName(head)}: statistics being computed`;
    b.classList.add("pending");
    b.addEventListener("click", () => choose(layer, head));
    return b;
  }

  function paintCell(b, entropy, title) {
    const t = 1 - entropy / state.info.max_entropy;  // sharper heads darker
    b.style.background = `hsl(215, 55%, ${Math.round(92 - 62 * Math.max(0, Math.min(1, t)))}%)`;
    b.title = title;
    b.setAttribute("aria-label", title);
    b.classList.remove("pending");
  }

  function paintGrid(grid) {  // grid[layer]: one summary per head, or null (not done yet)
    const buttons = $("grid").querySelectorAll("button.pending");
    for (const b of buttons) {
      const layer = Number(b.dataset.layer), heads = grid[layer];
      if (!heads) continue;
      if (b.dataset.head === "mean") {
        const mean = heads.reduce((a, s) => a + s.entropy, 0) / heads.length;
        paintCell(b, mean, `layer ${layer}, head average: mean entropy ${mean.toFixed(3)} nats`);
        continue;
      }
      const h = Number(b.dataset.head), s = heads[h];
      const what = state.info.kind === "text" ? tokenLabel(s.top) : `pixel ${pixelName(s.top)}`;
      paintCell(b, s.entropy, `layer ${layer}, head ${h}: mean entropy ${s.entropy.toFixed(3)} ` +
        `nats; receives most: ${what} (${s.top_received.toFixed(2)})`);
    }
    return grid.every((row) => row !== null);
  }

  async function pollGrid() {  // the server computes the statistics layer by layer
    let done = paintGrid(state.info.grid), stats_s = state.info.stats_s;
    while (!done) {
      await new Promise((r) => setTimeout(r, 400));
      const g = await source.grid();
      done = paintGrid(g.grid);
      stats_s = g.stats_s;
    }
    $("timing").textContent = embedded ? "static export" :
      `model run ${state.info.model_s.toFixed(2)} s, statistics ${(stats_s || 0).toFixed(2)} s`;
    document.body.dataset.statistics = "done";
  }

  function markGrid() {
    for (const b of $("grid").querySelectorAll("button")) {
      const on = Number(b.dataset.layer) === state.layer && b.dataset.head === String(state.head);
      b.setAttribute("aria-pressed", on ? "true" : "false");
    }
  }

  async function choose(layer, head) {
    state.layer = layer;
    state.head = head;
    markGrid();
    await refresh();
  }

  // ---- text
  let spans = [];

  function buildTokens() {
    const info = state.info, box = $("tokens"), frag = document.createDocumentFragment();
    const special = new Set(info.special);
    spans = info.tokens.map((text, i) => {
      if (info.gaps[i]) frag.appendChild(document.createTextNode(info.gaps[i]));
      const s = document.createElement("span");
      s.className = special.has(i) ? "tok special" : "tok";
      s.dataset.i = i;
      s.textContent = text;
      frag.appendChild(s);
      return s;
    });
    box.replaceChildren(frag);
    box.hidden = false;
    box.addEventListener("click", (e) => {
      const s = e.target.closest(".tok");
      if (s) select(Number(s.dataset.i));
    });
    box.addEventListener("mouseover", (e) => {
      const s = e.target.closest(".tok");
      if (s) hoverToken(Number(s.dataset.i));
    });
    $("keys").textContent = "Keys: \u2190 \u2192 previous / next token, Home / End, Esc: back to attention received.";
  }

  function colourTokens(values, what) {
    let max = 0, top = 0;
    values.forEach((v, j) => { if (v > max) { max = v; top = j; } });
    for (let j = 0; j < spans.length; j++) {
      const s = spans[j], t = max > 0 ? values[j] / max : 0;
      s.style.backgroundColor = heat(t);
      s.style.color = t > 0.6 ? "#fff" : "";
      s.dataset.w = values[j];
      s.classList.toggle("query", j === state.query);
    }
    $("tokens").dataset.what = what;
    return `Darkest: ${tokenLabel(top)}, ${fmt(max)}.`;
  }

  function hoverToken(j) {
    const v = state.values ? state.values[j] : undefined;
    const where = `layer ${state.layer}, ${headName(state.head)}`;
    $("hover").textContent = state.query === null
      ? `${tokenLabel(j)}: receives ${fmt(v)} in all (${where})`
      : `${tokenLabel(j)}: weight ${fmt(v)} from query ${tokenLabel(state.query)} (${where})`;
    $("hover").dataset.token = j;
  }

  // ---- pixels
  function pixelName(q) {
    const W = state.info.size[1];
    return `(${Math.floor(q / W)}, ${q % W})`;
  }

  function buildPixels() {
    const [H, W] = state.info.size, pic = $("picture"), map = $("map");
    for (const c of [pic, map]) { c.width = W; c.height = H; }
    const img = pic.getContext("2d").createImageData(W, H);
    state.info.picture.forEach((v, k) => { img.data[(k / 3 | 0) * 4 + (k % 3)] = v; });
    for (let k = 3; k < img.data.length; k += 4) img.data[k] = 255;
    pic.getContext("2d").putImageData(img, 0, 0);
    $("pixels").hidden = false;
    const at = (c, e) => {
      const r = c.getBoundingClientRect();
      const y = Math.min(H - 1, Math.floor((e.clientY - r.top) / r.height * H));
      const x = Math.min(W - 1, Math.floor((e.clientX - r.left) / r.width * W));
      return y * W + x;
    };
    pic.addEventListener("click", (e) => select(at(pic, e)));
    map.addEventListener("click", (e) => select(at(map, e)));
    for (const c of [pic, map]) c.addEventListener("mousemove", (e) => hoverPixel(at(c, e)));
    $("keys").textContent = "Keys: arrows move the query pixel, Esc: back to attention received.";
  }

  function drawMap(values, what) {
    const [H, W] = state.info.size, map = $("map"), ctx = map.getContext("2d");
    const img = ctx.createImageData(W, H);
    let max = 0;
    for (const v of values) if (v > max) max = v;
    values.forEach((v, k) => {
      const [r, g, b] = ramp(max > 0 ? Math.sqrt(v / max) : 0);
      img.data.set([r, g, b, 255], k * 4);
    });
    ctx.putImageData(img, 0, 0);
    map.dataset.weights = JSON.stringify(values);
    map.dataset.what = what;
    map.dataset.query = state.query === null ? "" : state.query;
    const m = $("marker");
    if (state.query === null) { m.hidden = true; return; }
    m.hidden = false;
    m.style.left = `${((state.query % W) + 0.5) / W * 100}%`;
    m.style.top = `${(Math.floor(state.query / W) + 0.5) / H * 100}%`;
    $("mapcaption").textContent = `what pixel ${pixelName(state.query)} attends to (${headName(state.head)})`;
  }

  function hoverPixel(q) {
    const v = state.values ? state.values[q] : undefined;
    $("hover").textContent = state.query === null
      ? `pixel ${pixelName(q)}: receives ${fmt(v)} in all (${headName(state.head)})`
      : `pixel ${pixelName(q)}: weight ${fmt(v)} from pixel ${pixelName(state.query)} (${headName(state.head)})`;
    $("hover").dataset.pixel = q;
  }

  // ---- one selection: a query's row, or (no query) attention received per token
  async function refresh() {
    const t0 = performance.now(), ticket = ++state.busy;
    const { layer, head, query } = state;
    try {
      let values, what, status;
      if (query === null) {
        const stats = await source.head(layer, head);
        values = stats.received;
        what = "received";
        status = `Attention each ${unit()} receives (summed over queries), ` +
          `layer ${layer}, ${headName(head)}. Click a ${unit()} to see its row.`;
      } else {
        values = await source.row(layer, head, query);
        what = "row";
        const name = state.info.kind === "text" ? tokenLabel(query) : `pixel ${pixelName(query)}`;
        status = `What ${name} attends to: layer ${layer}, ${headName(head)}.`;
      }
      // a newer selection is on its way: an answer that comes back late writes nothing
      // (not even the status line, which would then describe the older selection)
      if (ticket !== state.busy) return;
      $("status").textContent = status;
      state.values = values;
      if (state.info.kind === "text") {
        $("status").textContent += " " + colourTokens(values, what);
      } else drawMap(values, what);
      const box = state.info.kind === "text" ? $("tokens") : $("map");
      box.dataset.layer = layer;
      box.dataset.head = head;
      box.dataset.query = query === null ? "" : query;
      requestAnimationFrame(() => {
        if (ticket !== state.busy) return;
        document.body.dataset.rowMs = (performance.now() - t0).toFixed(1);
        document.body.dataset.shown = `${layer}/${head}/${query === null ? "" : query}`;
      });
    } catch (err) {
      if (ticket === state.busy) $("status").textContent = `Error: ${err.message}`;
    }
  }

  const unit = () => (state.info.kind === "text" ? "token" : "pixel");

  function select(query) {
    state.query = query;
    refresh();
  }

  document.addEventListener("keydown", (e) => {
    if (!state.info || e.target.closest?.("button")) return;
    const n = state.info.length, q = state.query;
    const W = state.info.kind === "pixels" ? state.info.size[1] : 1;
    const moves = {
      ArrowRight: 1, ArrowLeft: -1,
      ...(state.info.kind === "pixels" ? { ArrowDown: W, ArrowUp: -W } : {}),
    };
    if (e.key in moves) {
      select(q === null ? 0 : Math.max(0, Math.min(n - 1, q + moves[e.key])));
      if (state.info.kind === "text") spans[state.query].scrollIntoView({ block: "nearest" });
    } else if (e.key === "Home") select(0);
    else if (e.key === "End") select(n - 1);
    else if (e.key === "Escape") select(null);
    else return;
    e.preventDefault();
  });

  async function start() {
    try {
      state.info = await source.info();
    } catch (err) {
      $("status").textContent = `Error: ${err.message}`;
      return;
    }
    const info = state.info;
    $("title").textContent = info.title;
    $("timing").textContent = embedded ? "static export" :
      `model run ${info.model_s.toFixed(2)} s, statistics: computing...`;
    buildGrid();
    if (info.kind === "text") buildTokens(); else buildPixels();
    markGrid();
    $("status").textContent = `Click a ${unit()} to see what it attends to.`;
    requestAnimationFrame(() => {  // ready: tokens and grid painted, clicks answered
      document.body.dataset.readyMs = performance.now().toFixed(1);
      document.body.dataset.ready = "1";
    });
    pollGrid().catch((err) => { $("status").textContent = `Error: ${err.message}`; });
    if (state.query === null) refresh();  // attention received, once its layer is done
  }

  start();
})();
