/**
 * The browser's copy of one engine's state, kept current from the server extension's websocket:
 * one snapshot, then deltas (see `workbench/jupyter_server/coalesce.py` for the other side).
 *
 * Pure logic (no DOM, no JupyterLab) so jest can test it on synthetic messages. The chart and
 * the panel read the derived columns (`stepColumns`, `requestColumns`) and numbers from here.
 */

export const PHASES = ['prefill', 'decode', 'mixed', 'verify', 'relayout'];
export const SPAN_KINDS = ['queued', 'prefill', 'decode'];

export const PHASE_COLORS: Record<string, string> = {
  prefill: '#e6862b',
  decode: '#3b7dd8',
  mixed: '#8e5ccf',
  verify: '#2a9d8f',
  relayout: '#c0392b'
};

export const SPAN_COLORS: Record<string, string> = {
  queued: '#b8bec6',
  prefill: '#e6862b',
  decode: '#3b7dd8'
};

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

export interface ITimelinePart {
  steps: IStepEvent[];
  requests: IRequestEvent[];
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
  dropped?: number;
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
  requestsChanged: boolean;
  settingsChanged: string[];
  metricsChanged: boolean;
  stateChanged: boolean;
  error?: string;
}

/** Lifecycle times of one request (engine clock), and the lane it is drawn in. */
export interface IRequestInfo {
  id: string;
  lane: number;
  order: number;
  arrived?: number;
  scheduled?: number;
  first_token?: number;
  finished?: number;
  finishReason?: string | null;
  preemptions: number;
  lastTime: number;
}

export interface IStateOptions {
  /** Steps kept in memory (the newest). */
  maxSteps?: number;
  /** Requests kept in memory (the newest by arrival). */
  maxRequests?: number;
}

export class EngineState {
  constructor(options: IStateOptions = {}) {
    this.maxSteps = options.maxSteps ?? 20000;
    this.maxRequests = options.maxRequests ?? 500;
  }

  readonly maxSteps: number;
  readonly maxRequests: number;
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
  requests = new Map<string, IRequestInfo>();
  relayout: Dict[] = [];
  dropped = 0;
  /** Steps the last snapshot was asked for, and whether the engine holds earlier ones. */
  window = 0;
  older = false;
  lastSeq = -1;
  /** Deltas that arrived out of order or before the snapshot (ignored). */
  ignored = 0;
  private _lanes: number[] = []; // per lane: when its last request finished (Infinity: running)
  private _order = 0;

  get hasSnapshot(): boolean {
    return this.lastSeq >= 0;
  }

  /** Apply one server message; returns what changed. */
  apply(msg: ServerMessage): IChange {
    const change: IChange = {
      snapshot: false,
      newSteps: [],
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
      this._applyTimeline(msg.timeline, change);
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
    this.requests = new Map();
    this._lanes = [];
    this._order = 0;
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
      events.sort((a, b) => a.seq - b.seq);
      for (const ev of events) {
        this._noteTime(ev.time);
        this._applyRequestEvent(ev);
      }
      this._trimRequests();
      change.requestsChanged = true;
    }
    this.cursor = Math.max(this.cursor, part.cursor ?? 0, ...steps.map(s => s.seq), ...events.map(e => e.seq));
  }

  private _applyRequestEvent(ev: IRequestEvent): void {
    let info = this.requests.get(ev.request_id);
    if (!info) {
      info = {
        id: ev.request_id,
        lane: this._takeLane(ev.time),
        order: this._order++,
        preemptions: 0,
        lastTime: ev.time
      };
      this.requests.set(ev.request_id, info);
    }
    info.lastTime = Math.max(info.lastTime, ev.time);
    switch (ev.kind) {
      case 'arrived':
        info.arrived = info.arrived ?? ev.time;
        break;
      case 'scheduled':
        info.scheduled = info.scheduled ?? ev.time;
        break;
      case 'first_token':
        info.first_token = info.first_token ?? ev.time;
        break;
      case 'preempted':
        info.preemptions += 1;
        break;
      case 'finished':
        info.finished = info.finished ?? ev.time;
        info.finishReason = ev.detail ?? null;
        this._lanes[info.lane] = Math.max(
          this._lanes[info.lane] === Infinity ? -Infinity : this._lanes[info.lane],
          ev.time
        );
        break;
      default:
        break;
    }
  }

  /** The lowest lane free at time t (its last request finished by then), else a new one. */
  private _takeLane(t: number): number {
    for (let i = 0; i < this._lanes.length; i++) {
      if (this._lanes[i] <= t) {
        this._lanes[i] = Infinity;
        return i;
      }
    }
    this._lanes.push(Infinity);
    return this._lanes.length - 1;
  }

  private _trimRequests(): void {
    if (this.requests.size <= this.maxRequests) {
      return;
    }
    const byOrder = [...this.requests.values()].sort((a, b) => a.order - b.order);
    for (const info of byOrder.slice(0, this.requests.size - this.maxRequests)) {
      this.requests.delete(info.id);
    }
  }

  /** Seconds since `origin` (the chart's x). */
  x(t: number): number {
    return t - (this.origin ?? 0);
  }

  /** Requests not finished yet. */
  get activeRequests(): number {
    let n = 0;
    for (const r of this.requests.values()) {
      if (r.finished === undefined) {
        n++;
      }
    }
    return n;
  }
}

export interface ISpan {
  request_id: string;
  kind: string;
  start: number;
  end: number;
  open: boolean;
  lane: number;
}

/** Queued / prefill / decode spans of one request; open spans end at `now`. */
export function requestSpans(info: IRequestInfo, now: number): ISpan[] {
  const out: ISpan[] = [];
  const marks: Array<[string, number | undefined, number | undefined]> = [
    ['queued', info.arrived, info.scheduled],
    ['prefill', info.scheduled, info.first_token],
    ['decode', info.first_token, info.finished]
  ];
  for (const [kind, start, end] of marks) {
    if (start === undefined) {
      continue;
    }
    const open = end === undefined;
    if (open && info.finished !== undefined) {
      continue; // finished before this phase began (an abort, an error)
    }
    out.push({
      request_id: info.id,
      kind,
      start,
      end: open ? Math.max(start, now) : end!,
      open,
      lane: info.lane
    });
  }
  return out;
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
}

/** Bokeh column data for steps (x relative to the state's origin). */
export function stepColumns(state: EngineState, steps: IStepEvent[]): IStepColumns {
  const cols: IStepColumns = { left: [], right: [], phase: [], color: [], tokens: [], batch: [], ms: [], seq: [] };
  for (const s of steps) {
    const phase = PHASES.includes(s.phase) ? s.phase : 'mixed';
    cols.left.push(state.x(s.start));
    cols.right.push(state.x(Math.max(s.end, s.start)));
    cols.phase.push(phase);
    cols.color.push(PHASE_COLORS[phase]);
    cols.tokens.push((s.num_prefill_tokens ?? 0) + (s.num_decode_tokens ?? 0));
    cols.batch.push(s.batch ? s.batch.length : 0);
    cols.ms.push(Math.round((s.end - s.start) * 1e5) / 100);
    cols.seq.push(s.seq);
  }
  return cols;
}

export interface ISpanColumns {
  [key: string]: any[];
  left: number[];
  right: number[];
  lane: number[];
  kind: string[];
  color: string[];
  request_id: string[];
  ms: number[];
}

/** Bokeh column data for the request lanes, newest `limit` requests. */
export function requestColumns(state: EngineState, limit = 200): ISpanColumns {
  const cols: ISpanColumns = { left: [], right: [], lane: [], kind: [], color: [], request_id: [], ms: [] };
  const now = state.time ?? 0;
  const infos = [...state.requests.values()].sort((a, b) => a.order - b.order).slice(-limit);
  for (const info of infos) {
    for (const span of requestSpans(info, now)) {
      cols.left.push(state.x(span.start));
      cols.right.push(state.x(span.end));
      cols.lane.push(span.lane);
      cols.kind.push(span.kind);
      cols.color.push(SPAN_COLORS[span.kind]);
      cols.request_id.push(span.request_id);
      cols.ms.push(Math.round((span.end - span.start) * 1e5) / 100);
    }
  }
  return cols;
}

/** How many step bars per phase and request spans per kind there are (tests and badges). */
export function spanCounts(state: EngineState): { steps: Record<string, number>; spans: Record<string, number> } {
  const steps: Record<string, number> = {};
  for (const p of PHASES) {
    steps[p] = 0;
  }
  for (const s of state.steps) {
    steps[s.phase] = (steps[s.phase] ?? 0) + 1;
  }
  const spans: Record<string, number> = { queued: 0, prefill: 0, decode: 0 };
  const now = state.time ?? 0;
  for (const info of state.requests.values()) {
    for (const span of requestSpans(info, now)) {
      spans[span.kind] += 1;
    }
  }
  return { steps, spans };
}

/** The panel's headline numbers from a metrics dict. */
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
    itl: fixed(metrics.itl_p50_ms, 1)
  };
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
