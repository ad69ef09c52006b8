/**
 * Talking to the server extension: REST calls and the events websocket. The browser never
 * talks to an engine directly; the Jupyter server is the ZeroMQ client.
 */
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { EngineState, IChange, ServerMessage } from './model';
import { apiUrl, engineUrl, eventsSocketUrl } from './url';

export interface IEngineInfo {
  name: string;
  pid: number;
  model: string | null;
  transport: string;
  connection_file: string | null;
  started_here: boolean;
}

export interface ISettingSchema {
  name: string;
  kind: 'live' | 'relayout' | 'reload' | 'restart' | 'read-only';
  help: string;
  default: any;
  type: string; // "enum" | "bool" | "int" | "unicode"
  allow_none: boolean;
  values?: any[];
  min?: number | null;
  max?: number | null;
  read_only?: boolean; // a remote server's setting: shown, not changeable
  label?: string; // for people ("Prefix caching"); `name` is for code
  headline?: boolean; // one of the serving ideas shown first
}

/** A run of the run log, as `GET workbench/api/runs` lists it. */
export interface IRunInfo {
  id: number;
  kind: string;
  status: string;
  label: string | null;
  started_at: string;
  model: string | null;
  device: string | null;
  headline: Record<string, number | null>;
}

/** Bars of one part of a comparison: one per (metric, run). */
export interface IRunBars {
  metric: string[];
  run: string[];
  value: Array<number | null>;
  color: string[];
}

export interface IRunComparison {
  runs: string[];
  colors: string[];
  throughput: IRunBars;
  latency: IRunBars;
  /** What to draw: one figure per metric family (tok/s, TTFT, ITL), each on its own axis. */
  figures: Array<{ title: string; unit: string; rows: IRunBars }>;
  settings: Array<{ setting: string; values: string[] }>;
  same_weights: boolean | null;
  same_workload: boolean | null;
}

/** An error answered by the server extension (the engine's own message when it refused). */
export class WorkbenchError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly type: string = ''
  ) {
    super(message);
  }
}

export class WorkbenchAPI {
  constructor(readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings()) {}

  get baseUrl(): string {
    return this.settings.baseUrl;
  }

  async request<T>(url: string, init: RequestInit = {}): Promise<T> {
    const response = await ServerConnection.makeRequest(url, init, this.settings);
    const text = await response.text();
    let data: any = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = null;
    }
    if (!response.ok) {
      const message = (data && (data.message || data.reason)) || `${response.status} ${response.statusText}`;
      throw new WorkbenchError(message, response.status, (data && data.type) || '');
    }
    return data as T;
  }

  async listEngines(): Promise<IEngineInfo[]> {
    const data = await this.request<{ engines: IEngineInfo[] }>(apiUrl(this.baseUrl, 'engines'));
    return data.engines;
  }

  async schema(): Promise<ISettingSchema[]> {
    const data = await this.request<{ settings: ISettingSchema[] }>(apiUrl(this.baseUrl, 'schema'));
    return data.settings;
  }

  /** The run log's newest runs (bench, sweeps and their points, simulations), newest first. */
  async listRuns(limit = 50): Promise<IRunInfo[]> {
    const data = await this.request<{ runs: IRunInfo[] }>(`${apiUrl(this.baseUrl, 'runs')}?limit=${limit}`);
    return data.runs;
  }

  /** Runs side by side, as `workbench.runs.plots.comparison` draws them. */
  compareRuns(ids: number[]): Promise<IRunComparison> {
    return this.request(`${apiUrl(this.baseUrl, 'runs', 'compare')}?ids=${ids.join(',')}`);
  }

  engine(name: string): Promise<{ status: any; settings: any; metrics: any }> {
    return this.request(engineUrl(this.baseUrl, name));
  }

  /** Change settings; the engine validates and answers the effective settings. */
  async configure(name: string, changes: Record<string, any>): Promise<Record<string, any>> {
    const data = await this.request<{ settings: Record<string, any> }>(engineUrl(this.baseUrl, name, 'settings'), {
      method: 'PATCH',
      body: JSON.stringify(changes)
    });
    return data.settings;
  }

  start(body: { name?: string; model?: string | null; settings?: Record<string, any> }): Promise<{ name: string; status: any }> {
    return this.request(apiUrl(this.baseUrl, 'engines'), { method: 'POST', body: JSON.stringify(body) });
  }

  stop(name: string): Promise<any> {
    return this.request(engineUrl(this.baseUrl, name), { method: 'DELETE' });
  }

  eventsUrl(name: string, rate: number): string {
    const s = this.settings;
    return eventsSocketUrl(name, {
      baseUrl: s.baseUrl,
      wsUrl: s.wsUrl,
      rate,
      token: s.appendToken ? s.token : undefined
    });
  }
}

/**
 * One engine's live state: a websocket to the server extension feeding an `EngineState`.
 * Reconnects (with a new snapshot) after a dropped connection while the engine still runs.
 */
export class EngineConnection {
  constructor(
    readonly api: WorkbenchAPI,
    readonly name: string,
    readonly rate = 10
  ) {
    this._open();
  }

  readonly state = new EngineState();
  private _ws: WebSocket | null = null;
  private _changed = new Signal<this, IChange>(this);
  private _disposed = false;
  private _retry = 0;
  private _timer: any = null;
  error = '';

  get changed(): ISignal<this, IChange> {
    return this._changed;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  setRate(rate: number): void {
    if (this._ws && this._ws.readyState === WebSocket.OPEN) {
      this._ws.send(JSON.stringify({ rate }));
    }
  }

  /** Ask for a wider snapshot (4x the steps), reaching further back in time. */
  requestEarlier(): void {
    if (this._ws && this._ws.readyState === WebSocket.OPEN) {
      this._ws.send(JSON.stringify({ history: Math.max(1, this.state.window) * 4 }));
    }
  }

  private _open(): void {
    if (this._disposed) {
      return;
    }
    const ws = new WebSocket(this.api.eventsUrl(this.name, this.rate));
    this._ws = ws;
    ws.onmessage = ev => {
      let msg: ServerMessage;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return;
      }
      const change = this.state.apply(msg);
      if (change.snapshot) {
        this._retry = 0;
        this.error = '';
      }
      if (change.error) {
        this.error = change.error;
      }
      this._changed.emit(change);
    };
    ws.onclose = () => {
      if (this._disposed || this._ws !== ws) {
        return;
      }
      this._ws = null;
      const final = this.state.state === 'stopped' || this.state.state === 'dead';
      if (final) {
        return;
      }
      // The server closed or the network blipped: try again, a little later each time.
      this._retry = Math.min(this._retry + 1, 6);
      this._timer = setTimeout(() => this._open(), 500 * 2 ** this._retry);
      if (this._retry >= 3) {
        this.state.state = 'disconnected';
        this._changed.emit({
          snapshot: false,
          newSteps: [],
          newColumns: {},
          requestsChanged: false,
          settingsChanged: [],
          metricsChanged: false,
          stateChanged: true
        });
      }
    };
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    clearTimeout(this._timer);
    if (this._ws) {
      const ws = this._ws;
      this._ws = null;
      ws.close();
    }
    Signal.clearData(this);
  }
}
