/**
 * The browser's copy of one engine's state, kept current from the server extension's websocket:
 * one snapshot, then deltas (see `workbench/jupyter_server/coalesce.py` for the other side).
 *
 * Pure logic (no DOM, no JupyterLab) so jest can test it on synthetic messages. What is drawn is
 * not derived here: the server runs the tested Python reducer (`workbench/jupyter/reducer.py`)
 * and sends its plot columns and palette; this keeps them (`columns`, bounded) and maps them onto
 * the chart's fields (`stepColumns`, `requestColumns`), so every view draws the same thing.
 */

/** The step rows of the chart (the reducer's phases). */
export const PHASES = ['prefill', 'decode', 'mixed', 'verify', 'relayout'];
/** The lane states the reducer draws. */
export const LANE_STATES = ['queued', 'prefill', 'decode', 'verify', 'grammar'];

/** Columns as the reducer sends them: name -> values, all of one length. */
export type Columns = Record<string, any[]>;

/** The reducer's palette (`PHASE_COLORS`, `STATE_COLORS` in workbench/jupyter/reducer.py). */
export interface IPalette {
  phase: Record<string, string>;
  state: Record<string, string>;
}

/** A `workbench.timeline.StepEvent` as JSON (defaults omitted by the engine). */
export interface IStepEvent {
  seq: number;
  start: number;
  end: number;
  phase: string;
  num_prefill_tokens?: number;
  num_decode_tokens?: number;
  batch?: Array<[string, number, string]>;
  kv_blocks_used?: number;
  kv_blocks_total?: number;
  prefix_hit_tokens?: number;
  spec_proposed?: number;
  spec_accepted?: number;
  num_waiting?: number;
  num_running?: number;
  output_tokens?: number;
}

/** A `workbench.timeline.RequestEvent` as JSON. */
export interface IRequestEvent {
  seq: number;
  time: number;
  request_id: string;
  kind: string;
  detail?: string | null;
}

/** A `workbench.timeline.ChangeEvent` as JSON: one accepted settings change. */
export interface IChangeEvent {
  seq: number;
  start: number;
  end: number;
  changes: Record<string, [any, any]>;
  by?: string;
  relayout?: boolean;
}

export interface ITimelinePart {
  steps: IStepEvent[];
  requests: IRequestEvent[];
  changes?: IChangeEvent[];
  cursor: number;
}

export type Dict = Record<string, any>;

export interface ISnapshotMessage {
  type: 'snapshot';
  engine: string;
  status: Dict;
  settings: Dict;
  metrics: Dict;
  timeline: ITimelinePart;
  /** The reducer's rows of the drawn sources ("steps", "lanes"), x in seconds since t0. */
  columns?: Record<string, Columns>;
  t0?: number | null;
  palette?: IPalette;
  time?: number | null;
  rate?: number;
  /** Steps this snapshot was asked to hold (the first is small; the view may ask for more). */
  window?: number;
  /** The engine holds events before these: a wider window would show them. */
  older?: boolean;
}

export interface IDeltaMessage {
  type: 'delta';
  seq: number;
  time?: number | null;
  timeline?: ITimelinePart;
  settings?: Dict;
  changes?: Dict;
  metrics?: Dict;
  relayout?: Dict[];
  engine?: { state: string; [key: string]: any };
  /** status(), read again after a setting that reshapes it (which kernels and paths serve) */
  status?: Dict;
  dropped?: number;
  columns?: Record<string, Columns>;
}

export interface IErrorMessage {
  type: 'error';
  message: string;
  kind?: string;
}

export type ServerMessage = ISnapshotMessage | IDeltaMessage | IErrorMessage;

/** What one message changed, so views redraw only what they must. */
export interface IChange {
  snapshot: boolean;
  newSteps: IStepEvent[];
  /** The reducer's new rows, per drawn source. */
  newColumns: Record<string, Columns>;
  requestsChanged: boolean;
  settingsChanged: string[];
  metricsChanged: boolean;
  stateChanged: boolean;
  error?: string;
}

export interface IStateOptions {
  /** Steps kept in memory (the newest). */
  maxSteps?: number;
  /** Lane rectangles kept in memory (the newest). */
  maxLaneRows?: number;
}

export class EngineState {
  constructor(options: IStateOptions = {}) {
    this.maxSteps = options.maxSteps ?? 20000;
    this.maxLaneRows = options.maxLaneRows ?? 20000;
  }

  readonly maxSteps: number;
  readonly maxLaneRows: number;
  engine = '';
  status: Dict = {};
  settings: Dict = {};
  metrics: Dict = {};
  /** "connecting" until the snapshot; then "ready", "stopped" or "dead". */
  state = 'connecting';
  stateReason = '';
  cursor = 0;
  /** Latest engine time seen (seconds, engine's monotonic clock). */
  time: number | null = null;
  /** Engine time drawn as x = 0. */
  origin: number | null = null;
  steps: IStepEvent[] = [];
  /** What the chart draws: the reducer's rows, newest kept. */
  columns: Record<string, Columns> = { steps: {}, lanes: {}, changes: {}, host: {} };
  palette: IPalette = { phase: {}, state: {} };
  relayout: Dict[] = [];
  dropped = 0;
  /** Steps the last snapshot was asked for, and whether the engine holds earlier ones. */
  window = 0;
  older = false;
  lastSeq = -1;
  /** Deltas that arrived out of order or before the snapshot (ignored). */
  ignored = 0;

  get hasSnapshot(): boolean {
    return this.lastSeq >= 0;
  }

  /** Apply one server message; returns what changed. */
  apply(msg: ServerMessage): IChange {
    const change: IChange = {
      snapshot: false,
      newSteps: [],
      newColumns: {},
      requestsChanged: false,
      settingsChanged: [],
      metricsChanged: false,
      stateChanged: false
    };
    if (msg.type === 'error') {
      change.error = msg.message;
      return change;
    }
    if (msg.type === 'snapshot') {
      this._reset();
      change.snapshot = true;
      this.engine = msg.engine;
      this.status = msg.status ?? {};
      this.settings = { ...(msg.settings ?? {}) };
      this.metrics = msg.metrics ?? {};
      this.state = 'ready';
      this.lastSeq = 0;
      this.window = msg.window ?? 0;
      this.older = !!msg.older;
      change.settingsChanged = Object.keys(this.settings);
      change.metricsChanged = true;
      change.stateChanged = true;
      this._noteTime(msg.time);
      if (typeof msg.t0 === 'number') {
        this.origin = msg.t0; // x = 0 of the reducer's columns
      }
      if (msg.palette) {
        this.palette = msg.palette;
      }
      this._applyTimeline(msg.timeline, change);
      this._applyColumns(msg.columns, change);
      if (this.origin === null) {
        this.origin = this.time;
      }
      return change;
    }
    // a delta
    if (!this.hasSnapshot || (typeof msg.seq === 'number' && msg.seq <= this.lastSeq)) {
      this.ignored += 1;
      return change;
    }
    this.lastSeq = msg.seq ?? this.lastSeq + 1;
    this._noteTime(msg.time);
    if (msg.timeline) {
      this._applyTimeline(msg.timeline, change);
    }
    this._applyColumns(msg.columns, change);
    if (msg.settings || msg.changes) {
      const before = this.settings;
      this.settings = { ...before, ...(msg.settings ?? {}) };
      const names = new Set<string>(Object.keys(msg.changes ?? {}));
      for (const key of Object.keys(this.settings)) {
        if (before[key] !== this.settings[key]) {
          names.add(key);
        }
      }
      change.settingsChanged = [...names];
    }
    if (msg.metrics) {
      this.metrics = msg.metrics;
      change.metricsChanged = true;
    }
    if (msg.status) {
      this.status = msg.status;
      change.stateChanged = true;
    }
    if (msg.relayout && msg.relayout.length) {
      this.relayout = this.relayout.concat(msg.relayout).slice(-50);
      change.stateChanged = true;
    }
    if (msg.engine && msg.engine.state && msg.engine.state !== this.state) {
      this.state = msg.engine.state;
      this.stateReason = msg.engine.reason ?? '';
      change.stateChanged = true;
    }
    if (msg.dropped) {
      this.dropped += msg.dropped;
    }
    return change;
  }

  private _reset(): void {
    this.steps = [];
    this.columns = { steps: {}, lanes: {}, changes: {}, host: {} };
    this.cursor = 0;
    this.dropped = 0;
    this.relayout = [];
    this.origin = null;
    this.time = null;
  }

  private _noteTime(t: number | null | undefined): void {
    if (typeof t === 'number' && isFinite(t)) {
      this.time = this.time === null ? t : Math.max(this.time, t);
    }
  }

  private _applyTimeline(part: ITimelinePart | undefined, change: IChange): void {
    if (!part) {
      return;
    }
    const floor = this.cursor;
    const steps = (part.steps ?? []).filter(s => s.seq > floor);
    const events = (part.requests ?? []).filter(r => r.seq > floor);
    if (this.origin === null && (steps.length || events.length)) {
      this.origin = Math.min(...steps.map(s => s.start), ...events.map(e => e.time));
    }
    if (steps.length) {
      for (const s of steps) {
        this._noteTime(s.end);
      }
      this.steps.push(...steps);
      if (this.steps.length > this.maxSteps) {
        this.steps.splice(0, this.steps.length - this.maxSteps);
      }
      change.newSteps = steps;
    }
    if (events.length) {
      for (const ev of events) {
        this._noteTime(ev.time);
      }
      change.requestsChanged = true;
    }
    this.cursor = Math.max(this.cursor, part.cursor ?? 0, ...steps.map(s => s.seq), ...events.map(e => e.seq));
  }

  private _applyColumns(columns: Record<string, Columns> | undefined, change: IChange): void {
    if (!columns) {
      return;
    }
    const caps: Record<string, number> = {
      steps: this.maxSteps,
      lanes: this.maxLaneRows,
      changes: 1000,
      host: 3600
    };
    for (const [name, cols] of Object.entries(columns)) {
      const names = Object.keys(cols);
      if (!names.length || !cols[names[0]].length) {
        continue;
      }
      const kept = this.columns[name] ?? {};
      for (const c of names) {
        const joined = (kept[c] ?? []).concat(cols[c]);
        const cap = caps[name] ?? this.maxSteps;
        kept[c] = joined.length > cap ? joined.slice(joined.length - cap) : joined;
      }
      this.columns[name] = kept;
      change.newColumns[name] = cols;
    }
  }

  /** Seconds since `origin` (the chart's x). */
  x(t: number): number {
    return t - (this.origin ?? 0);
  }

  /** Requests on the chart: the reducer's lanes (the newest rows kept). */
  get requestCount(): number {
    return new Set(this.columns.lanes?.request ?? []).size;
  }

  /** Requests running or waiting, as the engine counts them. */
  get activeRequests(): number {
    const n = (v: any): number => (typeof v === 'number' && isFinite(v) ? v : 0);
    return n(this.metrics.num_running) + n(this.metrics.num_waiting);
  }
}

export interface IStepColumns {
  [key: string]: any[];
  left: number[];
  right: number[];
  phase: string[];
  color: string[];
  tokens: number[];
  batch: number[];
  ms: number[];
  seq: number[];
  composition: string[];
  parts: string[];
  spec: string[]; // drafts accepted/proposed, and the tokens jump-forward kept
  bound: string[]; // the step-time target that cut its prefill ("-": none)
}

/** The chart's step bars from the reducer's "steps" rows (all kept, or the new ones of a message). */
export function stepColumns(rows: Columns | undefined): IStepColumns {
  const r = rows ?? {};
  const col = (name: string): any[] => r[name] ?? [];
  const prefill = col('prefill_tokens');
  const decode = col('decode_tokens');
  return {
    left: col('left'),
    right: col('right'),
    phase: col('phase'),
    color: col('color'),
    tokens: prefill.map((p: number, i: number) => p + (decode[i] ?? 0)),
    batch: col('batch_size'),
    ms: col('duration_ms'),
    seq: col('seq'),
    composition: col('composition'),
    parts: col('parts'),
    spec: col('spec'),
    bound: col('bound')
  };
}

export interface ISpanColumns {
  [key: string]: any[];
  left: number[];
  right: number[];
  lane: number[];
  kind: string[];
  color: string[];
  request_id: string[];
  label: string[];
  ms: number[];
  start_ms: number[];
}

/** The chart's request lanes from the reducer's "lanes" rows (one per request and state). */
export function requestColumns(rows: Columns | undefined): ISpanColumns {
  const r = rows ?? {};
  const col = (name: string): any[] => r[name] ?? [];
  const left = col('left');
  const right = col('right');
  return {
    left,
    right,
    lane: col('lane'),
    kind: col('state'),
    color: col('color'),
    request_id: col('request'),
    label: col('label'),
    ms: left.map((l: number, i: number) => Math.round((right[i] - l) * 1e5) / 100),
    start_ms: left.map((l: number) => Math.round(l * 1e5) / 100)
  };
}

/** Each lane's name (y tick label): the label of the request that used it last, shortened. */
export function laneLabels(rows: Columns | undefined, maxChars: number): Record<number, string> {
  const lanes = rows?.lane ?? [];
  const labels = rows?.label ?? rows?.request ?? [];
  const out: Record<number, string> = {};
  lanes.forEach((lane: number, i: number) => {
    const text = String(labels[i] ?? '');
    out[lane] = text.length > maxChars ? `${text.slice(0, Math.max(1, maxChars - 1))}…` : text;
  });
  return out;
}

/**
 * The x range to show when following: the latest burst of activity (steps after the last idle
 * gap of more than `gap` seconds), at most `window` seconds wide, with a little padding; null
 * with nothing drawn. A 3 s run after a minute of idling fills the axis instead of being a
 * sliver at its edge. A settings change made after the burst (while idle) is activity too: the
 * range reaches it, still at most `window` wide, so its marker is on screen.
 */
export function latestActivity(
  steps: Columns | undefined,
  window: number,
  gap = 5,
  changes: Columns | undefined = undefined
): { start: number; end: number } | null {
  const left: number[] = steps?.left ?? [];
  const right: number[] = steps?.right ?? [];
  const changed: number[] = (changes?.end ?? changes?.t ?? []).filter((t: any) => typeof t === 'number');
  if (!left.length && !changed.length) {
    return null;
  }
  let start: number;
  let end: number;
  if (left.length) {
    const order = left.map((_, i) => i).sort((a, b) => left[a] - left[b]);
    end = Math.max(...right);
    start = left[order[order.length - 1]];
    for (let k = order.length - 2; k >= 0; k--) {
      const i = order[k];
      if (start - right[i] > gap || end - left[i] > window) {
        break;
      }
      start = left[i];
    }
  } else {
    start = end = Math.min(...changed);
  }
  const lastChange = changed.length ? Math.max(...changed) : -Infinity;
  if (lastChange > end) {
    end = lastChange;
    start = Math.max(start, end - window);
  }
  const pad = Math.max(0.02 * (end - start), 0.01, start === end ? 0.5 : 0);
  return { start: start - pad, end: end + pad };
}

/** Settings-change markers as the chart draws them (the reducer's "changes" rows). */
export interface IChangeMarker {
  t: number;
  end: number;
  label: string;
  by: string;
  applyMs: number;
  relayout: boolean;
}

export function changeMarkers(rows: Columns | undefined): IChangeMarker[] {
  const r = rows ?? {};
  return (r.t ?? []).map((t: number, i: number) => ({
    t,
    end: r.end?.[i] ?? t,
    label: String(r.label?.[i] ?? ''),
    by: String(r.by?.[i] ?? ''),
    applyMs: Number(r.apply_ms?.[i] ?? 0),
    relayout: !!r.relayout?.[i]
  }));
}

/** How many step bars per phase and lane rectangles per state are kept (tests and badges). */
export function spanCounts(state: EngineState): { steps: Record<string, number>; spans: Record<string, number> } {
  const steps: Record<string, number> = {};
  const spans: Record<string, number> = {};
  for (const p of PHASES) {
    steps[p] = 0;
  }
  for (const k of LANE_STATES) {
    spans[k] = 0;
  }
  for (const p of state.columns.steps?.phase ?? []) {
    steps[p] = (steps[p] ?? 0) + 1;
  }
  for (const k of state.columns.lanes?.state ?? []) {
    spans[k] = (spans[k] ?? 0) + 1;
  }
  return { steps, spans };
}

export interface ILiveNumbers {
  tokS: string;
  queue: string;
  running: string;
  kv: string;
  kvBlocks: string;
  hitRate: string;
  acceptance: string;
  ttft: string;
  itl: string;
  cpu: string;
  memory: string;
  limit: string;
  stepParts: string;
}

export function liveNumbers(metrics: Dict): ILiveNumbers {
  const num = (v: any): number | null => (typeof v === 'number' && isFinite(v) ? v : null);
  const fixed = (v: any, digits: number, suffix = ''): string => {
    const n = num(v);
    return n === null ? '–' : `${n.toFixed(digits)}${suffix}`;
  };
  const pct = (v: any): string => {
    const n = num(v);
    return n === null ? '–' : `${(n * 100).toFixed(1)}%`;
  };
  const kvUsed = num(metrics.kv_blocks_used);
  const kvTotal = num(metrics.kv_blocks_total);
  return {
    tokS: fixed(metrics.output_tok_s, 1),
    queue: fixed(metrics.num_waiting, 0),
    running: fixed(metrics.num_running, 0),
    kv: pct(metrics.kv_usage),
    kvBlocks: kvUsed !== null && kvTotal !== null ? `${kvUsed} / ${kvTotal} blocks` : '',
    hitRate: pct(metrics.prefix_hit_rate),
    acceptance: pct(metrics.spec_acceptance_rate),
    ttft: fixed(metrics.ttft_p50_ms, 0),
    itl: fixed(metrics.itl_p50_ms, 1),
    cpu: fixed(metrics.process_cpu_cores, 1),
    memory: fixed(num(metrics.process_rss_mb) === null ? null : metrics.process_rss_mb / 1024, 2),
    ...stepTime(metrics)
  };
}

/** The part of a step that took most of the recent steps' time ("layers 71%"), and every part's
 * share for its hover, from the engine's `step_parts_share` (what the Python dashboard shows too). */
function stepTime(metrics: Dict): { limit: string; stepParts: string } {
  const shares: Array<[string, number]> = Object.entries(metrics.step_parts_share ?? {})
    .filter((kv): kv is [string, number] => typeof kv[1] === 'number' && kv[1] >= 0.01)
    .sort((a, b) => b[1] - a[1]);
  if (!shares.length) {
    return { limit: '–', stepParts: '' };
  }
  const pct = ([name, v]: [string, number]): string => `${name} ${(v * 100).toFixed(0)}%`;
  // CUDA only: the GPU's time on steps rather than waiting for the host between them
  const busy = metrics.device_busy_share;
  const device = typeof busy === 'number' && isFinite(busy) ? ` · device busy ${(busy * 100).toFixed(0)}%` : '';
  return { limit: pct(shares[0]), stepParts: shares.map(pct).join(', ') + device };
}

/** The host plot's rows (the reducer's "host" source), nulls (not measured) as NaN: gaps. */
export function hostColumns(rows: Columns | undefined): Record<string, number[]> {
  const out: Record<string, number[]> = {};
  for (const name of ['t', 'engine_cpu_pct', 'host_cpu_pct', 'host_mem_pct', 'kv_pct', 'engine_rss_mb']) {
    out[name] = (rows?.[name] ?? []).map((v: any) => (typeof v === 'number' ? v : NaN));
  }
  return out;
}

/** One MoE layer of the routing heatmap: each expert's tokens, share of the layer's and colour. */
export interface IExpertRow {
  layer: number;
  imbalance: number | null;
  cells: Array<{ expert: number; tokens: number; share: number; color: string }>;
}

/**
 * The routing heatmap of a mixture-of-experts engine from its metrics (`expert_load`: tokens per
 * expert of each MoE layer over the recent window, `moe_layer_imbalance` and `moe_imbalance`, all
 * computed by the engine); null on dense models.
 * Cells shade from white to the prefill blue by share of the busiest cell.
 */
export function expertHeatmap(metrics: Dict): { rows: IExpertRow[]; worst: number | null } | null {
  const load = metrics.expert_load;
  if (!Array.isArray(load) || !load.length) {
    return null;
  }
  const shares: number[][] = load.map((row: number[]) => {
    const total = row.reduce((a, b) => a + b, 0);
    return row.map(n => (total ? n / total : 0));
  });
  const top = Math.max(1e-9, ...shares.flat());
  const shade = (f: number): string => {
    const mix = (a: number, b: number) => Math.round(a + (b - a) * f);
    return `rgb(${mix(245, 76)}, ${mix(245, 114)}, ${mix(245, 176)})`; // #f5f5f5 -> #4C72B0
  };
  const perLayer = Array.isArray(metrics.moe_layer_imbalance) ? metrics.moe_layer_imbalance : [];
  const rows = load.map((row: number[], layer: number) => {
    return {
      layer,
      imbalance: typeof perLayer[layer] === 'number' ? perLayer[layer] : null,
      cells: row.map((tokens, expert) => ({
        expert,
        tokens,
        share: shares[layer][expert],
        color: shade(shares[layer][expert] / top)
      }))
    };
  });
  const worst = typeof metrics.moe_imbalance === 'number' ? metrics.moe_imbalance : null;
  return { rows, worst };
}

/** "1h 02m", "3m 07s", "12s". */
export function formatUptime(seconds: number | null | undefined): string {
  if (typeof seconds !== 'number' || !isFinite(seconds) || seconds < 0) {
    return '–';
  }
  const s = Math.floor(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const sec = s % 60;
  const pad = (n: number) => String(n).padStart(2, '0');
  if (h > 0) {
    return `${h}h ${pad(m)}m`;
  }
  if (m > 0) {
    return `${m}m ${pad(sec)}s`;
  }
  return `${sec}s`;
}
