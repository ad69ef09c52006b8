/**
 * BokehJS, loaded from the installed `bokeh` Python package through the server extension
 * (`<base>/workbench/static/bokeh/`), so the JS always matches the Python package (and the
 * notebook dashboard, which embeds the same version). Nothing is bundled or fetched from a CDN.
 */
import { bokehScriptUrl } from './url';
import { Columns, EngineState, PHASES, requestColumns, spanCounts, stepColumns } from './model';

// BokehJS has no typings on the page; the little we use is typed loosely here.
type BokehNS = any;

declare global {
  interface Window {
    Bokeh?: BokehNS;
  }
}

const FILES = ['bokeh.min.js', 'bokeh-api.min.js'];
let loading: Promise<BokehNS> | null = null;

function addScript(src: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const el = document.createElement('script');
    el.src = src;
    el.async = false;
    el.dataset.workbench = 'bokeh';
    el.onload = () => resolve();
    el.onerror = () => reject(new Error(`could not load ${src}`));
    document.head.appendChild(el);
  });
}

/** Window.Bokeh with the plotting API, loading the scripts once. */
export function loadBokeh(baseUrl: string): Promise<BokehNS> {
  if (window.Bokeh && window.Bokeh.Plotting) {
    return Promise.resolve(window.Bokeh);
  }
  if (!loading) {
    loading = (async () => {
      if (!window.Bokeh) {
        await addScript(bokehScriptUrl(baseUrl, FILES[0]));
      }
      if (!window.Bokeh.Plotting) {
        await addScript(bokehScriptUrl(baseUrl, FILES[1]));
      }
      if (!window.Bokeh || !window.Bokeh.Plotting) {
        throw new Error('BokehJS loaded without its plotting API');
      }
      return window.Bokeh;
    })();
    loading.catch(() => {
      loading = null;
    });
  }
  return loading;
}

export interface IChartOptions {
  /** Height of the steps track and of the request lanes, in px. */
  stepsHeight?: number;
  lanesHeight?: number;
  /** Seconds of history shown while following the live end. */
  window?: number;
  /** Steps kept in the chart's data source. */
  rollover?: number;
  toolbar?: boolean;
}

/**
 * Engine steps by phase (one row per phase) above request lanes (queued / prefill / decode / verify),
 * sharing a time axis that follows the live end.
 */
export class TimelineChart {
  constructor(
    readonly host: HTMLElement,
    readonly state: EngineState,
    readonly options: IChartOptions = {}
  ) {}

  private _bk: BokehNS = null;
  private _steps: any = null;
  private _spans: any = null;
  private _xRange: any = null;
  private _views: any[] = [];
  private _ready: Promise<void> | null = null;
  private _disposed = false;

  get ready(): boolean {
    return this._bk !== null && this._steps !== null;
  }

  /** Build the figures (loads BokehJS first). */
  async render(baseUrl: string): Promise<void> {
    if (!this._ready) {
      this._ready = this._render(baseUrl);
    }
    return this._ready;
  }

  private async _render(baseUrl: string): Promise<void> {
    const Bokeh = await loadBokeh(baseUrl);
    if (this._disposed) {
      return;
    }
    this._bk = Bokeh;
    const opts = this.options;
    const { figure, gridplot, show } = Bokeh.Plotting;
    this._steps = new Bokeh.ColumnDataSource({ data: stepColumns(undefined) });
    this._spans = new Bokeh.ColumnDataSource({ data: requestColumns(undefined) });
    this._xRange = new Bokeh.DataRange1d({
      follow: 'end',
      follow_interval: opts.window ?? 30,
      range_padding: 0.02
    });
    const tools = opts.toolbar === false ? '' : 'xpan,xwheel_zoom,box_zoom,reset,save';
    const steps = figure({
      height: opts.stepsHeight ?? 140,
      sizing_mode: 'stretch_width',
      x_range: this._xRange,
      y_range: new Bokeh.FactorRange({ factors: [...PHASES].reverse() }),
      tools,
      toolbar_location: opts.toolbar === false ? null : 'above',
      title: 'engine steps by phase',
      min_border_left: 60
    });
    const stepBars = steps.hbar({
      y: { field: 'phase' },
      left: { field: 'left' },
      right: { field: 'right' },
      height: 0.8,
      fill_color: { field: 'color' },
      line_color: null,
      source: this._steps
    });
    steps.add_tools(
      new Bokeh.HoverTool({
        renderers: [stepBars],
        tooltips: [
          ['step', '@seq'],
          ['phase', '@phase'],
          ['tokens', '@tokens'],
          ['batch', '@composition'],
          ['ms', '@ms']
        ]
      })
    );
    steps.xaxis.visible = false;
    const lanes = figure({
      height: opts.lanesHeight ?? 200,
      sizing_mode: 'stretch_width',
      x_range: this._xRange,
      y_range: new Bokeh.DataRange1d({ flipped: true, range_padding: 0.05 }),
      tools,
      toolbar_location: opts.toolbar === false ? null : 'above',
      title: 'requests (queued / prefill / decode / verify)',
      x_axis_label: 'engine time (s)',
      min_border_left: 60
    });
    const spanBars = lanes.hbar({
      y: { field: 'lane' },
      left: { field: 'left' },
      right: { field: 'right' },
      height: 0.7,
      fill_color: { field: 'color' },
      line_color: null,
      source: this._spans
    });
    lanes.add_tools(
      new Bokeh.HoverTool({
        renderers: [spanBars],
        tooltips: [
          ['request', '@request_id'],
          ['span', '@kind'],
          ['ms', '@ms']
        ]
      })
    );
    lanes.yaxis.axis_label = 'lane';
    lanes.yaxis.ticker = new Bokeh.BasicTicker({ min_interval: 1, num_minor_ticks: 0 });
    lanes.ygrid.visible = false;
    const grid = gridplot([[steps], [lanes]], {
      sizing_mode: 'stretch_width',
      toolbar_location: opts.toolbar === false ? null : 'right',
      merge_tools: true
    });
    const views = await show(grid, this.host);
    this._views = Array.isArray(views) ? views : [views];
    if (this._disposed) {
      this._removeViews();
      return;
    }
    this.reset();
  }

  /** Redraw everything from the state (after a snapshot, or once the figures exist). */
  reset(): void {
    if (!this.ready) {
      return;
    }
    this._steps.data = stepColumns(this.state.columns.steps);
    this._spans.data = requestColumns(this.state.columns.lanes);
    this._publishCounts();
  }

  /** Append the reducer's new rows (streamed; older ones roll over). */
  add(columns: Record<string, Columns>): void {
    if (!this.ready) {
      return; // reset() draws everything from the state once the figures exist
    }
    if (columns.steps) {
      this._steps.stream(stepColumns(columns.steps), this.options.rollover ?? 5000);
    }
    if (columns.lanes) {
      this._spans.stream(requestColumns(columns.lanes), this.state.maxLaneRows);
    }
    this._publishCounts();
  }

  /** Counts exposed as data attributes (read by the browser tests and handy when debugging). */
  private _publishCounts(): void {
    const counts = spanCounts(this.state);
    const d = this.host.dataset;
    for (const [phase, n] of Object.entries(counts.steps)) {
      d[`steps${phase[0].toUpperCase()}${phase.slice(1)}`] = String(n);
    }
    for (const [kind, n] of Object.entries(counts.spans)) {
      d[`spans${kind[0].toUpperCase()}${kind.slice(1)}`] = String(n);
    }
    d.requests = String(this.state.requests.size);
    d.cursor = String(this.state.cursor);
  }

  private _removeViews(): void {
    for (const v of this._views) {
      try {
        v.remove();
      } catch {
        // already gone
      }
    }
    this._views = [];
  }

  dispose(): void {
    this._disposed = true;
    this._removeViews();
    this.host.innerHTML = '';
  }
}
