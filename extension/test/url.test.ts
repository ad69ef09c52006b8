import {
  apiUrl,
  bokehScriptUrl,
  engineUrl,
  eventsSocketUrl,
  joinUrl,
  toWebSocketBase,
  withQuery
} from '../src/url';

describe('joinUrl', () => {
  it('joins with exactly one slash', () => {
    expect(joinUrl('http://h:8888/', '/workbench/', 'api')).toBe('http://h:8888/workbench/api');
    expect(joinUrl('/', 'workbench')).toBe('/workbench');
    expect(joinUrl('/user/alice/', 'workbench/api')).toBe('/user/alice/workbench/api');
  });
  it('skips empty pieces', () => {
    expect(joinUrl('http://h/', '', 'a')).toBe('http://h/a');
    expect(joinUrl()).toBe('');
  });
});

describe('REST URLs', () => {
  it('keep the server base URL (JupyterHub prefix)', () => {
    const base = 'https://hub.example.org/user/alice/';
    expect(apiUrl(base, 'engines')).toBe('https://hub.example.org/user/alice/workbench/api/engines');
    expect(engineUrl(base, 'lab', 'settings')).toBe(
      'https://hub.example.org/user/alice/workbench/api/engines/lab/settings'
    );
    expect(engineUrl(base, 'lab')).toBe('https://hub.example.org/user/alice/workbench/api/engines/lab');
  });
  it('encode names as one segment', () => {
    expect(engineUrl('/', 'a b/c')).toBe('/workbench/api/engines/a%20b%2Fc');
    expect(apiUrl('/', 'x?y')).toBe('/workbench/api/x%3Fy');
  });
  it('serve BokehJS from the server extension', () => {
    expect(bokehScriptUrl('http://h:1/base/', 'bokeh.min.js')).toBe(
      'http://h:1/base/workbench/static/bokeh/bokeh.min.js'
    );
  });
});

describe('websocket URL', () => {
  it('maps http to ws and https to wss', () => {
    expect(toWebSocketBase('http://h:8888/x/')).toBe('ws://h:8888/x/');
    expect(toWebSocketBase('https://h/x/')).toBe('wss://h/x/');
    expect(toWebSocketBase('HTTPS://h/')).toBe('wss://h/');
  });
  it('prefers the server wsUrl and adds rate and token', () => {
    expect(
      eventsSocketUrl('e2e', { baseUrl: 'http://h:1/u/bob/', wsUrl: 'ws://h:1/u/bob/', rate: 5, token: 'abc' })
    ).toBe('ws://h:1/u/bob/workbench/api/engines/e2e/events?rate=5&token=abc');
  });
  it('derives the websocket base from baseUrl and leaves the token out when not asked', () => {
    expect(eventsSocketUrl('lab', { baseUrl: 'https://h/p/', rate: 10 })).toBe(
      'wss://h/p/workbench/api/engines/lab/events?rate=10'
    );
  });
});

describe('withQuery', () => {
  it('encodes and appends', () => {
    expect(withQuery('/a', { since: 3, x: 'a b' })).toBe('/a?since=3&x=a%20b');
    expect(withQuery('/a?b=1', { c: 2 })).toBe('/a?b=1&c=2');
    expect(withQuery('/a', { none: undefined, nil: null })).toBe('/a');
  });
});
