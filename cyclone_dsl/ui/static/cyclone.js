// Light progressive enhancement: confirmations, live counts, a small live chart.
document.addEventListener("submit", (event) => {
  const form = event.target;
  const question = form.dataset ? form.dataset.confirm : null;
  if (question && !window.confirm(question)) event.preventDefault();
});

async function refreshCounts() {
  try {
    const counts = await (await fetch("/api/counts")).json();
    for (const el of document.querySelectorAll("[data-count]")) {
      el.textContent = String(counts[el.dataset.count] || 0);
    }
  } catch (e) { /* the next tick retries */ }
}
setInterval(refreshCounts, 2000);

// The queues chart: the server draws the frame (cyclone_dsl/ui/chart.py); this keeps
// the samples of the last `data-window` seconds and redraws, in the same markup, the
// series, the count axis's ticks, the legend's values and the time range.
const SVG_NS = "http://www.w3.org/2000/svg";
const SERIES = ["available", "running", "waiting"];
const samples = [];

function niceTicks(top) {  // the same as chart.nice_ticks
  const whole = Math.max(1, Math.ceil(top));
  const raw = whole / 4;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = Math.max(1, Math.round([1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= raw)));
  const ticks = [];
  for (let i = 0; i <= Math.ceil(whole / step); i++) ticks.push(i * step);
  return ticks;
}

function svg(name, attributes, text) {
  const element = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, String(value));
  if (text !== undefined) element.textContent = text;
  return element;
}

const clock = (ms) => new Date(ms).toISOString().slice(11, 19);  // UTC, as chart.time_range

function drawChart(chart) {
  const left = Number(chart.dataset.left), right = Number(chart.dataset.right);
  const top = Number(chart.dataset.top), bottom = Number(chart.dataset.bottom);
  const windowMs = Number(chart.dataset.window) * 1000;
  const now = Date.now();
  const ticks = niceTicks(Math.max(0, ...samples.flatMap((s) => SERIES.map((n) => s[n]))));
  const highest = ticks[ticks.length - 1];
  const y = (value) => (bottom - (value / highest) * (bottom - top)).toFixed(1);
  const x = (t) => (right - ((now - t) / windowMs) * (right - left)).toFixed(1);
  const axis = chart.querySelector(".y-axis");
  for (const old of axis.querySelectorAll(".tick")) old.remove();
  const title = axis.querySelector(".axis-title");
  for (const value of ticks) {
    const tick = svg("g", { class: "tick", "data-value": value });
    tick.appendChild(svg("line", { x1: left - 5, y1: y(value), x2: right, y2: y(value), stroke: "#eee" }));
    tick.appendChild(svg("text", { class: "tick-label", x: left - 8, y: (Number(y(value)) + 4).toFixed(1), "text-anchor": "end" }, String(value)));
    axis.insertBefore(tick, title);
  }
  for (const name of SERIES) {
    const line = chart.querySelector(`.series [data-series="${name}"]`);
    const points = samples.map((s) => `${x(s.t)},${y(s[name])}`);
    if (points.length === 1) points.unshift(`${(x(samples[0].t) - 4).toFixed(1)},${y(samples[0][name])}`);
    if (line) line.setAttribute("d", points.map((p, i) => `${i === 0 ? "M" : "L"}${p}`).join(" "));
    const value = chart.querySelector(`.legend [data-series="${name}"] .legend-value`);
    if (value && samples.length) value.textContent = String(samples[samples.length - 1][name]);
  }
  chart.dataset.samples = String(samples.length);
  const range = chart.querySelector(".time-range");
  if (range) range.textContent = `${clock(now - windowMs)} - ${clock(now)} UTC`;
}

async function refreshChart() {
  const chart = document.getElementById("chart");
  if (!chart) return;
  try {
    const stats = await (await fetch("/api/stats")).json();
    const sample = { t: Date.now() };
    for (const name of SERIES) sample[name] = stats.queues.reduce((sum, q) => sum + (q[name] || 0), 0);
    samples.push(sample);
    const windowMs = Number(chart.dataset.window) * 1000;
    while (samples.length && samples[0].t < sample.t - windowMs) samples.shift();
    drawChart(chart);
  } catch (e) { /* the next tick retries */ }
}
setInterval(refreshChart, 2000);
refreshChart();
