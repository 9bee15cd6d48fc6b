// The engine dashboard: polls the server's stats (/v1/console/stats) while it is shown.
// Every number comes from the server (scheduler stats, Prometheus counters and histograms);
// this file only formats and draws them.
import { fetchJSON } from "./api.js";
import { cssColor, drawLineChart } from "./chart.js";

const STATS_URL = "/v1/console/stats";
const POLL_MS = 1000;
const $ = (id) => document.getElementById(id);

let active = false;
let timer = null;
let lastStats = null;

export function showDashboard(visible) {
  active = visible;
  clearTimeout(timer);
  if (active) poll();
}

async function poll() {
  if (!active) return;
  try {
    lastStats = await fetchJSON(STATS_URL);
    render(lastStats);
    setStatus(lastStats.metrics_enabled ? "" :
      "metrics are off (--disable-log-stats): token counts and latencies are not recorded");
  } catch (error) {
    setStatus(`could not read the stats: ${error.message}`, true);
  }
  // the next poll after this one ends, so slow answers never pile up
  if (active) timer = setTimeout(poll, document.hidden ? POLL_MS * 5 : POLL_MS);
}

function setStatus(text, isError = false) {
  const status = $("dashboard-status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

// Sets an element's text and keeps the raw number in data-value (for scripts and tests).
function show(id, value, format = String) {
  const element = $(id);
  element.dataset.value = value === null || value === undefined ? "" : String(value);
  element.textContent = value === null || value === undefined ? "–" : format(value);
}

const integer = (v) => Math.round(v).toLocaleString("en-US");
const percent = (v) => `${(100 * v).toFixed(1)}%`;
const rate = (v) => v.toFixed(1);

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${(value * 1000).toFixed(value < 0.01 ? 2 : 1)} ms` : `${value.toFixed(2)} s`;
}

function render(stats) {
  if (stats.model) $("server-model").textContent = stats.model;
  show("stat-running", stats.requests.running);
  show("stat-waiting", stats.requests.waiting);
  show("stat-open", stats.requests.open);
  show("stat-finished", stats.requests.finished, integer);
  $("stat-preemptions").textContent = `${integer(stats.requests.preemptions)} preemptions`;
  show("stat-kv", stats.kv_cache.usage, percent);
  const kv = stats.kv_cache;
  $("stat-kv-blocks").textContent = kv.num_blocks
    ? `${integer(kv.num_blocks - kv.num_free_blocks)} of ${integer(kv.num_blocks)} blocks` : "";
  show("stat-prefix", stats.prefix_cache.hit_rate, percent);
  $("stat-prefix-recent").textContent = stats.prefix_cache.recent_hit_rate === null ? ""
    : `last ${stats.recent_s} s: ${percent(stats.prefix_cache.recent_hit_rate)}`;
  show("stat-gen-tps", stats.tokens.generation_per_s, rate);
  $("stat-prompt-tps").textContent = stats.tokens.prompt_per_s === null ? ""
    : `prompt: ${rate(stats.tokens.prompt_per_s)} tok/s`;
  show("stat-gen-total", stats.tokens.generation_total, integer);
  $("stat-prompt-total").textContent = stats.tokens.prompt_total === null ? ""
    : `${integer(stats.tokens.prompt_total)} prompt tokens`;

  for (const name of ["ttft", "itl"]) {
    const latency = stats.latency_s[name];
    for (const window of ["recent", "total"]) {
      const row = $(`lat-${name}-${window}`);
      const values = latency[window];
      if (window === "recent") row.querySelector(".win").textContent = `last ${stats.recent_s} s`;
      row.querySelector(".n").textContent = values ? integer(values.count) : "–";
      for (const q of ["p50", "p90", "p99"]) {
        row.querySelector(`.${q}`).textContent = values ? seconds(values[q]) : "–";
      }
    }
  }
  drawCharts(stats);
}

function drawCharts(stats) {
  const series = stats.series;
  // the span picked, within the history the server keeps
  const span = Math.min(Number($("chart-span").value) || stats.history_s, stats.history_s);
  const axis = { times: series.time, now: stats.server_time, spanSeconds: span };
  drawLineChart($("tps-chart"), {
    ...axis,
    series: [
      { values: series.prompt_tokens_per_s, color: cssColor("--prompt", "#e0822d") },
      { values: series.generation_tokens_per_s, color: cssColor("--gen", "#2f6fdb") },
    ],
  });
  drawLineChart($("requests-chart"), {
    ...axis,
    integer: true,
    series: [
      { values: series.waiting, color: cssColor("--waiting", "#c0392b") },
      { values: series.running, color: cssColor("--running", "#2e9d5b") },
    ],
  });
}

// Redraw at the new size when the window changes (the canvases follow their CSS width), and
// at once for a new span.
window.addEventListener("resize", () => { if (active && lastStats) drawCharts(lastStats); });
$("chart-span").addEventListener("change", () => { if (lastStats) drawCharts(lastStats); });
