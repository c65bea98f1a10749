// Live charts of the cluster's load over the last minutes (tokens/s, queue depth, TTFT), drawn by
// uPlot (uPlot.iife.min.js, vendored). Fed by each /v1/cluster poll (playground.js): every
// worker's heartbeat carries running totals (tokens generated, the sum and count of its times to
// first token) and when it read them, so a rate is the growth of a worker's totals between two
// of its beats. The figures are the whole cluster's for the page's model, not this tab's.
"use strict";

const WINDOW_S = 300;  // the charts show at most the last 5 minutes
const CHART_HEIGHT = 120;
const CLOCK = {hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false};
const clock = (t) => new Date(t * 1000).toLocaleTimeString([], CLOCK);

// Samples of named series over time, oldest dropped past WINDOW_S; `columns` is uPlot's data
// (times in seconds first), its arrays changed in place.
class Ring {
  constructor(names, windowS = WINDOW_S) {
    this.names = names;
    this.windowS = windowS;
    this.columns = [[], ...names.map(() => [])];
  }

  push(t, values) {
    this.columns[0].push(t);
    this.names.forEach((name, i) => this.columns[i + 1].push(values[name] ?? null));
    const keep = this.columns[0].findIndex((x) => x >= t - this.windowS);
    if (keep > 0) for (const column of this.columns) column.splice(0, keep);
  }

  // The chart's data: the times and the named series.
  data(names) {
    return [this.columns[0], ...names.map((name) => this.columns[this.names.indexOf(name) + 1])];
  }
}

// Each chart (its box is #chart-<name>): its title, and its series (label, CSS colour, key in `load`).
const CHARTS = {
  tokens: {title: "Tokens/s", series: [{label: "tokens/s", color: "--accent", key: "tokensPerS"}]},
  queue: {title: "Queue depth", series: [{label: "waiting", color: "--warn", key: "waiting"},
                                         {label: "running", color: "--accent", key: "running"}]},
  ttft: {title: "TTFT (ms)", series: [{label: "mean TTFT", color: "--accent", key: "ttftMs"}]},
};
const load = new Ring(["tokensPerS", "waiting", "running", "ttftMs"]);
const charts = {};  // name -> uPlot instance (the tests read their data)
const beats = new Map();  // worker -> its last beat's totals and what they grew by since the one before

// A worker's beat, read again: its totals' growth since its previous beat (none for its first
// beat, a repeated one, or totals that went down: a restart under the same name starts over).
function beatOf(worker) {
  const last = beats.get(worker.worker);
  if (last && last.at === worker.at) return last;
  const beat = {at: worker.at, tokens: worker.generated_tokens, ttftSum: worker.ttft_sum_s,
                ttftCount: worker.ttft_count, grown: null};
  if (last && beat.tokens >= last.tokens && beat.ttftCount >= last.ttftCount && beat.at > last.at) {
    beat.grown = {seconds: beat.at - last.at, tokens: beat.tokens - last.tokens,
                  firsts: beat.ttftCount - last.ttftCount, ttftSum: beat.ttftSum - last.ttftSum};
  }
  return beat;
}

// The cluster's tokens/s and mean TTFT (ms) over each worker's last interval between beats;
// null where no worker has two beats yet, or (TTFT) no request got its first token then.
function rates(workers) {
  const seen = new Map();
  for (const worker of workers) {
    if (worker.at == null || worker.generated_tokens == null) continue;  // a worker without totals
    seen.set(worker.worker, beatOf(worker));
  }
  beats.clear();
  seen.forEach((beat, name) => beats.set(name, beat));
  const grown = [...seen.values()].map((beat) => beat.grown).filter(Boolean);
  if (!grown.length) return {tokensPerS: null, ttftMs: null};
  const firsts = grown.reduce((n, g) => n + g.firsts, 0);
  return {tokensPerS: grown.reduce((rate, g) => rate + g.tokens / g.seconds, 0),
          ttftMs: firsts ? 1000 * grown.reduce((s, g) => s + g.ttftSum, 0) / firsts : null};
}

// One /v1/cluster answer: a sample on every chart.
function recordLoad(cluster) {
  const workers = cluster.workers.filter((w) => w.model === cluster.model);
  load.push(Date.now() / 1000, {
    ...rates(workers),
    waiting: cluster.queue.waiting,
    running: workers.reduce((n, w) => n + w.running, 0),
  });
  for (const [name, chart] of Object.entries(charts)) chart.setData(load.data(CHARTS[name].series.map((s) => s.key)));
}

function makeChart(name, {title, series}) {
  const style = getComputedStyle(document.documentElement);
  const color = (variable) => style.getPropertyValue(variable).trim();
  const axis = {stroke: color("--muted"), grid: {stroke: color("--line"), width: 1},
                ticks: {stroke: color("--line"), width: 1}};
  const box = $(`chart-${name}`);
  charts[name] = new uPlot({
    title,
    width: box.clientWidth,
    height: CHART_HEIGHT,
    cursor: {drag: {x: false, y: false}},
    legend: {show: series.length > 1, live: false},  // the series' names only, where there are several
    scales: {y: {range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1]}},  // from 0, always
    axes: [{...axis, space: 80, values: (u, ticks) => ticks.map(clock)}, {...axis, size: 44}],
    series: [{}, ...series.map((s) => ({label: s.label, stroke: color(s.color), width: 2, points: {show: false}}))],
  }, load.data(series.map((s) => s.key)), box);
}

document.addEventListener("DOMContentLoaded", () => {
  for (const [name, chart] of Object.entries(CHARTS)) makeChart(name, chart);
  new ResizeObserver(() => {
    for (const [name, chart] of Object.entries(charts)) {
      chart.setSize({width: $(`chart-${name}`).clientWidth, height: CHART_HEIGHT});
    }
  }).observe($("charts"));
});
