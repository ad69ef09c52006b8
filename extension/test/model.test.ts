import {
  EngineState,
  IDeltaMessage,
  IRequestEvent,
  ISnapshotMessage,
  IStepEvent,
  changeMarkers,
  expertHeatmap,
  formatUptime,
  laneLabels,
  latestActivity,
  liveNumbers,
  requestColumns,
  spanCounts,
  stepColumns
} from '../src/model';

import fixture from './fixtures/reducer_messages.json';

// Written by tests/test_lab_coalesce.py from the Python coalescer and reducer: a snapshot and a delta.
const reducerMessages = fixture as unknown as [ISnapshotMessage, IDeltaMessage];

function step(seq: number, start: number, phase: string, extra: Partial<IStepEvent> = {}): IStepEvent {
  return { seq, start, end: start + 0.01, phase, ...extra };
}

function rev(seq: number, time: number, id: string, kind: string, detail?: string): IRequestEvent {
  return { seq, time, request_id: id, kind, detail };
}

function snapshot(over: Partial<ISnapshotMessage> = {}): ISnapshotMessage {
  return {
    type: 'snapshot',
    engine: 'e',
    status: { model: 'tiny', device: 'cpu', uptime_s: 3 },
    settings: { max_num_seqs: 64, batching: 'continuous' },
    metrics: { output_tok_s: 0 },
    timeline: { steps: [], requests: [], cursor: 0 },
    time: 100,
    rate: 10,
    ...over
  };
}

describe('EngineState', () => {
  it('starts from the snapshot', () => {
    const st = new EngineState();
    const ch = st.apply(
      snapshot({
        timeline: {
          steps: [step(2, 100.0, 'prefill'), step(4, 100.02, 'decode')],
          requests: [rev(1, 99.99, 'r1', 'arrived'), rev(3, 100.0, 'r1', 'scheduled')],
          cursor: 4
        }
      })
    );
    expect(ch.snapshot).toBe(true);
    expect(st.state).toBe('ready');
    expect(st.cursor).toBe(4);
    expect(st.steps.map(s => s.seq)).toEqual([2, 4]);
    expect(st.origin).toBeCloseTo(99.99);
    expect(ch.settingsChanged.sort()).toEqual(['batching', 'max_num_seqs']);
  });

  it('ignores deltas before the snapshot and out of order', () => {
    const st = new EngineState();
    const d: IDeltaMessage = { type: 'delta', seq: 1, metrics: { output_tok_s: 5 } };
    expect(st.apply(d).metricsChanged).toBe(false);
    st.apply(snapshot());
    expect(st.apply(d).metricsChanged).toBe(true);
    expect(st.apply(d).metricsChanged).toBe(false); // same seq again
    expect(st.ignored).toBe(2);
  });

  it('appends new timeline events once (dedupe by seq)', () => {
    const st = new EngineState();
    st.apply(snapshot({ timeline: { steps: [step(1, 100, 'prefill')], requests: [], cursor: 1 } }));
    const ch = st.apply({
      type: 'delta',
      seq: 1,
      timeline: { steps: [step(1, 100, 'prefill'), step(2, 100.1, 'decode')], requests: [], cursor: 2 }
    });
    expect(ch.newSteps.map(s => s.seq)).toEqual([2]);
    expect(st.steps.length).toBe(2);
    expect(st.cursor).toBe(2);
  });

  it('bounds the steps it keeps', () => {
    const st = new EngineState({ maxSteps: 3 });
    st.apply(snapshot());
    st.apply({
      type: 'delta',
      seq: 1,
      timeline: { steps: [1, 2, 3, 4, 5].map(i => step(i, 100 + i, 'decode')), requests: [], cursor: 5 }
    });
    expect(st.steps.map(s => s.seq)).toEqual([3, 4, 5]);
  });

  it('merges settings and reports what changed', () => {
    const st = new EngineState();
    st.apply(snapshot());
    const ch = st.apply({
      type: 'delta',
      seq: 1,
      settings: { max_num_seqs: 8, batching: 'continuous' },
      changes: { max_num_seqs: 8 }
    });
    expect(st.settings.max_num_seqs).toBe(8);
    expect(ch.settingsChanged).toEqual(['max_num_seqs']);
  });

  it('tracks the engine state and dropped counts', () => {
    const st = new EngineState();
    st.apply(snapshot());
    const ch = st.apply({ type: 'delta', seq: 1, engine: { state: 'stopped' }, dropped: 7 });
    expect(ch.stateChanged).toBe(true);
    expect(st.state).toBe('stopped');
    expect(st.dropped).toBe(7);
  });

  it('takes status read again after a setting that reshapes it', () => {
    const st = new EngineState();
    st.apply(snapshot({ status: { kernel_variant: 'avx512_bf16', prefill_attention: 'sdpa' } }));
    const ch = st.apply({ type: 'delta', seq: 1, status: { kernel_variant: 'torch', prefill_attention: null } });
    expect(ch.stateChanged).toBe(true);  // the info table (its kernels row) is drawn again
    expect(st.status.kernel_variant).toBe('torch');
    expect(st.apply({ type: 'delta', seq: 2, metrics: {} }).stateChanged).toBe(false);
    expect(st.status.kernel_variant).toBe('torch');
  });

  it('a new snapshot replaces everything', () => {
    const st = new EngineState();
    st.apply(snapshot({ timeline: { steps: [step(5, 100, 'decode')], requests: [], cursor: 5 } }));
    st.apply(snapshot({ timeline: { steps: [], requests: [], cursor: 9 }, time: 200 }));
    expect(st.steps).toEqual([]);
    expect(st.cursor).toBe(9);
    expect(st.origin).toBe(200);
  });

  it('keeps the window of the snapshot and whether earlier steps exist', () => {
    const st = new EngineState();
    st.apply(snapshot({ window: 500, older: true, timeline: { steps: [step(7, 100, 'decode')], requests: [], cursor: 7 } }));
    expect([st.window, st.older]).toEqual([500, true]);
    // the wider snapshot the view asked for replaces the narrow one, earlier steps included
    st.apply(snapshot({ window: 2000, older: false, timeline: { steps: [step(2, 90, 'prefill'), step(7, 100, 'decode')], requests: [], cursor: 7 } }));
    expect([st.window, st.older, st.steps.map(s => s.seq)]).toEqual([2000, false, [2, 7]]);
    st.apply(snapshot());
    expect([st.window, st.older]).toEqual([0, false]); // an older server sends neither
  });

  it('passes errors through', () => {
    const st = new EngineState();
    expect(st.apply({ type: 'error', message: 'boom' }).error).toBe('boom');
  });
});

describe('drawn columns: the Python reducer\'s', () => {
  it('counts requests from the reducer\'s lanes and active ones from the engine\'s metrics', () => {
    const st = new EngineState();
    const [snap, delta] = reducerMessages;
    st.apply({ ...snap, metrics: { num_running: 2, num_waiting: 1 } });
    st.apply(delta);
    const ids = new Set(st.columns.lanes.request);
    expect(ids.size).toBeGreaterThan(0);
    expect(st.requestCount).toBe(ids.size);
    expect(st.activeRequests).toBe(3);
    st.apply({ ...delta, seq: (delta.seq ?? 0) + 1, columns: undefined, metrics: { num_running: 0, num_waiting: 0 } });
    expect(st.activeRequests).toBe(0);
  });

  it('keeps the snapshot\'s columns, palette and origin', () => {
    const st = new EngineState();
    const [snap] = reducerMessages;
    const ch = st.apply(snap);
    expect(ch.newColumns.steps.phase).toEqual(['prefill']);
    expect(st.origin).toBe(snap.t0);
    expect(st.palette).toEqual(snap.palette);
    const sc = stepColumns(st.columns.steps);
    expect(sc.phase).toEqual(['prefill']);
    expect(sc.color).toEqual([snap.palette!.phase.prefill]);
    expect(sc.tokens).toEqual([5]);
    expect(sc.left[0]).toBeCloseTo(0.1);
  });

  it('appends a delta\'s rows and maps lanes onto the chart', () => {
    const st = new EngineState();
    const [snap, delta] = reducerMessages;
    st.apply(snap);
    const ch = st.apply(delta);
    expect(stepColumns(ch.newColumns.steps).phase).toEqual(['mixed', 'decode']);
    expect(stepColumns(ch.newColumns.steps).bound).toEqual([
      'cut to the 400 ms step target (predicted 392 ms)',
      '-'
    ]);
    expect(st.columns.steps.phase).toEqual(['prefill', 'mixed', 'decode']);
    const rc = requestColumns(st.columns.lanes);
    expect(rc.kind).toEqual(['queued', 'prefill', ...delta.columns!.lanes.state]);
    expect(rc.lane).toEqual([0, 0, ...delta.columns!.lanes.lane]);
    expect(rc.color[0]).toBe(snap.palette!.state.queued);
    expect(rc.ms[1]).toBeCloseTo(50);
    const counts = spanCounts(st);
    expect(counts.steps).toEqual({ prefill: 1, decode: 1, mixed: 1, verify: 0, relayout: 0 });
    expect(counts.spans.decode).toBe(3);
  });

  it('bounds the rows it keeps', () => {
    const st = new EngineState({ maxSteps: 2 });
    const [snap, delta] = reducerMessages;
    st.apply(snap);
    st.apply(delta);
    expect(st.columns.steps.seq).toEqual([6, 8]);
  });
});

describe('markers and lanes', () => {
  it('keeps the settings changes as markers', () => {
    const st = new EngineState();
    const [snap, delta] = reducerMessages;
    st.apply(snap);
    st.apply(delta);
    const [m] = changeMarkers(st.columns.changes);
    expect(m.label).toBe("quantization: 'none' → 'int8'");
    expect(m.by).toBe('notebook kernel (pid 1)');
    expect(m.relayout).toBe(true);
    expect(m.applyMs).toBeCloseTo(30);
    expect(m.end - m.t).toBeCloseTo(0.03);
    expect(st.cursor).toBe(10);
  });

  it('names each lane after the request that used it last', () => {
    const st = new EngineState();
    const [snap, delta] = reducerMessages;
    st.apply(snap);
    expect(laneLabels(st.columns.lanes, 24)).toEqual({ 0: 'Once upon a time' });
    expect(laneLabels(st.columns.lanes, 6)).toEqual({ 0: 'Once …' });
    st.apply(delta);
    const names = laneLabels(st.columns.lanes, 24);
    expect(Object.values(names)).toContain('bbbbbb');
    expect(requestColumns(st.columns.lanes).label[0]).toBe('Once upon a time');
  });

  it('fits the axis to the latest burst of activity', () => {
    // a minute of idling between two runs: follow shows the second run, not a sliver of it
    const steps = { left: [0, 0.1, 60, 61, 62.9], right: [0.05, 0.2, 60.5, 61.5, 63] };
    const r = latestActivity(steps, 60)!;
    expect(r.start).toBeLessThan(60);
    expect(r.start).toBeGreaterThan(59.8);
    expect(r.end).toBeGreaterThan(63);
    expect(r.end).toBeLessThan(63.2);
    // a long run is capped at the window
    const long = { left: [0, 10, 20, 30], right: [9, 19, 29, 39] };
    expect(latestActivity(long, 25)!.start).toBeGreaterThan(19);
    expect(latestActivity({ left: [], right: [] }, 30)).toBeNull();
  });

  it('reaches a settings change made while idle', () => {
    // steps until 63 s, then an int8 flip at 90 s with no request running: the marker is on screen
    const steps = { left: [60, 61, 62.9], right: [60.5, 61.5, 63] };
    const changes = { t: [90], end: [90.4] };
    const r = latestActivity(steps, 60, 5, changes)!;
    expect(r.end).toBeGreaterThan(90.4);
    expect(r.start).toBeLessThan(60); // the burst still fits in the window
    const far = latestActivity(steps, 20, 5, { t: [200], end: [200] })!;
    expect(far.end).toBeGreaterThan(200);
    expect(far.start).toBeGreaterThanOrEqual(179);
    // a change before any step is drawn
    const alone = latestActivity({ left: [], right: [] }, 30, 5, { t: [5], end: [5] })!;
    expect(alone.start).toBeLessThan(5);
    expect(alone.end).toBeGreaterThan(5);
    // changes inside the burst change nothing
    expect(latestActivity(steps, 60, 5, { t: [61], end: [61] })).toEqual(latestActivity(steps, 60));
  });
});

describe('expert routing heatmap', () => {
  it('draws the engine\'s expert_load, one row per MoE layer', () => {
    const heat = expertHeatmap({
      expert_load: [[6, 2, 0, 0], [2, 2, 2, 2]],
      moe_layer_imbalance: [3, 1],
      moe_imbalance: 3
    })!;
    expect(heat.rows.map(r => r.layer)).toEqual([0, 1]);
    expect(heat.rows[0].cells.map(c => c.tokens)).toEqual([6, 2, 0, 0]);
    expect(heat.rows[0].cells[0].share).toBeCloseTo(0.75);
    expect(heat.rows[0].imbalance).toBeCloseTo(3);
    expect(heat.rows[1].imbalance).toBeCloseTo(1);
    expect(heat.rows[0].cells[0].color).toBe('rgb(76, 114, 176)'); // the busiest cell: full colour
    expect(heat.rows[0].cells[2].color).toBe('rgb(245, 245, 245)');
    expect(heat.worst).toBe(3);
  });
  it('is absent on dense models', () => {
    expect(expertHeatmap({ output_tok_s: 5 })).toBeNull();
    expect(expertHeatmap({ expert_load: [] })).toBeNull();
  });
});

describe('formatting', () => {
  it('formats live numbers', () => {
    const n = liveNumbers({
      output_tok_s: 123.456,
      num_waiting: 3,
      num_running: 2,
      kv_usage: 0.25,
      kv_blocks_used: 8,
      kv_blocks_total: 32,
      prefix_hit_rate: 0.5,
      spec_acceptance_rate: 0
    });
    expect(n.tokS).toBe('123.5');
    expect(n.queue).toBe('3');
    expect(n.kv).toBe('25.0%');
    expect(n.kvBlocks).toBe('8 / 32 blocks');
    expect(n.hitRate).toBe('50.0%');
    expect(n.acceptance).toBe('0.0%');
    expect(liveNumbers({}).tokS).toBe('–');
  });
  it('adds the device busy share to the step parts where CUDA measured it', () => {
    const shares = { step_parts_share: { layers: 0.7, sample: 0.3 } };
    expect(liveNumbers(shares).stepParts).toBe('layers 70%, sample 30%');
    expect(liveNumbers({ ...shares, device_busy_share: 0.954 }).stepParts).toBe(
      'layers 70%, sample 30% · device busy 95%'
    );
  });
  it('formats uptime', () => {
    expect(formatUptime(5)).toBe('5s');
    expect(formatUptime(65)).toBe('1m 05s');
    expect(formatUptime(3725)).toBe('1h 02m');
    expect(formatUptime(undefined)).toBe('–');
  });
});
