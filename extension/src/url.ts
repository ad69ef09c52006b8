/**
 * URLs of the Serving Workbench server extension, built from the Jupyter server's base URL so
 * they keep working under a prefix (JupyterHub's /user/<name>/, a reverse proxy).
 *
 * Pure functions (no JupyterLab imports) so jest can test them directly.
 */

/** Join URL path pieces with exactly one slash between them; keeps a scheme and a leading slash. */
export function joinUrl(...parts: string[]): string {
  const pieces = parts.filter(p => p !== undefined && p !== null && p !== '');
  if (pieces.length === 0) {
    return '';
  }
  let out = pieces[0];
  for (const piece of pieces.slice(1)) {
    const left = out.replace(/\/+$/, '');
    const right = piece.replace(/^\/+/, '');
    out = right ? `${left}/${right}` : `${left}/`;
  }
  return out;
}

/** The last path segment, percent-encoded (engine names, file names). */
export function segment(value: string): string {
  return encodeURIComponent(value);
}

/** `<base>/workbench/api/<path...>` (each extra path piece is encoded as one segment). */
export function apiUrl(baseUrl: string, ...path: string[]): string {
  return joinUrl(baseUrl, 'workbench/api', ...path.map(segment));
}

/** `<base>/workbench/api/engines/<name>[/<sub>]`. */
export function engineUrl(baseUrl: string, name: string, sub?: string): string {
  const url = joinUrl(baseUrl, 'workbench/api/engines', segment(name));
  return sub ? joinUrl(url, sub) : url;
}

/** Add query arguments (skipping undefined/null values) to a URL that may already have some. */
export function withQuery(
  url: string,
  query: Record<string, string | number | boolean | null | undefined>
): string {
  const args = Object.entries(query)
    .filter(([, v]) => v !== undefined && v !== null && v !== '')
    .map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(String(v))}`);
  if (args.length === 0) {
    return url;
  }
  return url + (url.includes('?') ? '&' : '?') + args.join('&');
}

/** The websocket base from the page's http(s) base URL: http -> ws, https -> wss. */
export function toWebSocketBase(baseUrl: string): string {
  return baseUrl.replace(/^http(s?):\/\//i, (_m, s) => (s ? 'wss://' : 'ws://'));
}

export interface ISocketOptions {
  /** The server's websocket base (ServerConnection.ISettings.wsUrl); derived from baseUrl if empty. */
  wsUrl?: string;
  baseUrl: string;
  /** Appended as ?token= when given (only when the settings ask for it: cookies cover the rest). */
  token?: string;
  /** Flush rate asked of the server, in Hz. */
  rate?: number;
}

/** `ws(s)://.../workbench/api/engines/<name>/events?rate=<Hz>[&token=...]`. */
export function eventsSocketUrl(name: string, opts: ISocketOptions): string {
  const base = opts.wsUrl || toWebSocketBase(opts.baseUrl);
  const url = joinUrl(base, 'workbench/api/engines', segment(name), 'events');
  return withQuery(url, { rate: opts.rate, token: opts.token || undefined });
}

/** `<base>/workbench/static/bokeh/<file>`: BokehJS served from the installed bokeh package. */
export function bokehScriptUrl(baseUrl: string, file: string): string {
  return joinUrl(baseUrl, 'workbench/static/bokeh', segment(file));
}
