"use strict";
// qkv explain: an interactive head view (in the spirit of BertViz). Every token is shown with
// textContent, never innerHTML, so token text cannot become markup.
(function () {
  const data = JSON.parse(document.getElementById("qkv-data").textContent);
  const L = data.tokens.length;
  const H = data.heads;
  const raw = atob(data.weights);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  const q16 = new Uint16Array(bytes.buffer); // little-endian uint16, value / 65535
  const weight = (l, h, i, j) => q16[((l * H + h) * L + i) * L + j] / 65535;
  const color = (h) => `hsl(${Math.round((h * 360) / H)}, 70%, 45%)`;
  const SVG = "http://www.w3.org/2000/svg";
  const SVG_TAGS = new Set(["svg", "g", "line", "text", "rect"]);

  const state = {
    layer: data.layer,
    heads: new Set(data.head === null ? [...Array(H).keys()] : [data.head]),
    focus: data.focus, // pinned token (a query row) or null
    hover: null,
  };

  const el = (tag, attrs, text) => {
    const e = SVG_TAGS.has(tag) ? document.createElementNS(SVG, tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  };

  // ---------------------------------------------------------------- controls
  const layerSel = document.getElementById("layer");
  for (let l = 0; l < data.layers; l++) layerSel.appendChild(el("option", { value: l }, `layer ${l}`));
  layerSel.value = String(state.layer);
  layerSel.addEventListener("change", () => { state.layer = Number(layerSel.value); render(); });

  const chips = document.getElementById("heads");
  for (let h = 0; h < H; h++) {
    const b = el("button", { class: "head-chip", "data-head": h, title: `head ${h} (click: toggle, double-click: only this head)` }, String(h));
    b.style.setProperty("--c", color(h));
    b.addEventListener("click", () => {
      if (state.heads.has(h)) state.heads.delete(h); else state.heads.add(h);
      render();
    });
    b.addEventListener("dblclick", () => { state.heads = new Set([h]); render(); });
    chips.appendChild(b);
  }
  document.getElementById("all-heads").addEventListener("click", () => {
    state.heads = new Set([...Array(H).keys()]);
    render();
  });

  // ---------------------------------------------------------------- head view (SVG)
  const ROW = 22, TOP = 28, GAP = 200, PAD = 8;
  const svg = document.getElementById("view");
  svg.setAttribute("height", TOP + L * ROW + 10);
  const rowY = (i) => TOP + i * ROW + ROW / 2;
  const leftTok = [], rightTok = [];
  for (let i = 0; i < L; i++) {
    const t = el("text", { y: rowY(i) + 4, "text-anchor": "end", class: "tok tok-left", "data-i": i }, data.tokens[i]);
    t.addEventListener("mouseenter", () => { state.hover = i; render(); });
    t.addEventListener("mouseleave", () => { state.hover = null; render(); });
    t.addEventListener("click", () => { state.focus = state.focus === i ? null : i; render(); });
    svg.appendChild(t);
    leftTok.push(t);
    const r = el("text", { y: rowY(i) + 4, class: "tok tok-right", "data-j": i }, data.tokens[i]);
    svg.appendChild(r);
    rightTok.push(r);
  }
  // Columns as wide as the longest token (bold, so measured with some slack).
  svg.setAttribute("width", 1000);
  let longest = 40;
  for (const t of leftTok) longest = Math.max(longest, t.getComputedTextLength() * 1.12);
  const LEFT_X = PAD + longest + 6, RIGHT_X = LEFT_X + GAP;
  svg.setAttribute("width", RIGHT_X + 6 + longest + PAD);
  for (const t of leftTok) t.setAttribute("x", LEFT_X - 6);
  for (const t of rightTok) t.setAttribute("x", RIGHT_X + 6);
  svg.appendChild(el("text", { x: LEFT_X - 6, y: 16, "text-anchor": "end", class: "axis" }, "token"));
  svg.appendChild(el("text", { x: RIGHT_X + 6, y: 16, class: "axis" }, "attends to"));
  const lines = el("g", { class: "lines" });
  svg.insertBefore(lines, svg.firstChild);

  // ---------------------------------------------------------------- matrix (canvas)
  const canvas = document.getElementById("matrix");
  const CELL = Math.max(4, Math.min(22, Math.floor(300 / Math.max(L, 1))));
  canvas.width = canvas.height = L * CELL;

  function meanRow(i) {
    const hs = [...state.heads];
    const out = new Float64Array(L);
    if (!hs.length) return out;
    for (const h of hs) for (let j = 0; j < L; j++) out[j] += weight(state.layer, h, i, j);
    for (let j = 0; j < L; j++) out[j] /= hs.length;
    return out;
  }

  function render() {
    const active = state.hover !== null ? state.hover : state.focus;
    for (const b of chips.children) b.classList.toggle("off", !state.heads.has(Number(b.dataset.head)));
    layerSel.value = String(state.layer);
    lines.replaceChildren();
    for (const h of [...state.heads].sort((a, b) => a - b)) {
      for (let i = 0; i < L; i++) {
        if (active !== null && i !== active) continue;
        for (let j = 0; j < L; j++) {
          const w = weight(state.layer, h, i, j);
          if (w < 0.01) continue;
          lines.appendChild(el("line", {
            class: "attn", x1: LEFT_X, y1: rowY(i), x2: RIGHT_X, y2: rowY(j),
            stroke: color(h), "stroke-width": 2, "stroke-opacity": w.toFixed(3),
          }));
        }
      }
    }
    leftTok.forEach((t, i) => t.classList.toggle("active", i === active));
    const row = active !== null ? meanRow(active) : null;
    rightTok.forEach((t, j) => {
      t.classList.toggle("hit", row !== null && row[j] >= 0.1);
    });

    // The mean of the selected heads as a matrix; the active row outlined.
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    for (let i = 0; i < L; i++) {
      const r = meanRow(i);
      for (let j = 0; j < L; j++) {
        const v = Math.min(1, r[j]); // white (0) to dark blue (1), linear
        ctx.fillStyle = `rgb(${Math.round(255 - 225 * v)}, ${Math.round(255 - 200 * v)}, ${Math.round(255 - 95 * v)})`;
        ctx.fillRect(j * CELL, i * CELL, CELL, CELL);
      }
    }
    if (active !== null) {
      ctx.strokeStyle = "#d00";
      ctx.lineWidth = 2;
      ctx.strokeRect(1, active * CELL + 1, L * CELL - 2, CELL - 2);
    }

    // Top keys of the active token, mean of the selected heads.
    const list = document.getElementById("top");
    list.replaceChildren();
    const caption = document.getElementById("top-caption");
    if (active === null) {
      caption.textContent = "Hover or click a token on the left.";
      return;
    }
    const n = state.heads.size;
    const which = n === 1 ? `head ${[...state.heads][0]}` : `mean of ${n} heads`;
    caption.textContent = `“${data.tokens[active]}” (token ${active}) in layer ${state.layer}, ${which}:`;
    const order = [...row.keys()].sort((a, b) => row[b] - row[a]).slice(0, data.top);
    for (const j of order) {
      const tr = el("tr", {});
      tr.appendChild(el("td", { class: "name" }, data.tokens[j]));
      tr.appendChild(el("td", { class: "val" }, row[j].toFixed(2)));
      const cell = el("td", {});
      const bar = el("span", { class: "bar" });
      bar.style.width = `${Math.round(row[j] * 160)}px`;
      cell.appendChild(bar);
      tr.appendChild(cell);
      list.appendChild(tr);
    }
  }

  window.qkvView = { state, render, weight };
  render();
})();
