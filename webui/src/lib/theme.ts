/** Light, dark, or the system's choice; kept in localStorage, applied as `data-theme` on <html>. */
export type Theme = 'system' | 'light' | 'dark';
const KEY = 'nebula-theme';

export function storedTheme(): Theme {
  try {
    const t = localStorage.getItem(KEY);
    if (t === 'light' || t === 'dark') return t;
  } catch {
    /* storage off */
  }
  return 'system';
}

export function applyTheme(t: Theme): void {
  if (t === 'system') document.documentElement.removeAttribute('data-theme');
  else document.documentElement.setAttribute('data-theme', t);
  try {
    if (t === 'system') localStorage.removeItem(KEY);
    else localStorage.setItem(KEY, t);
  } catch {
    /* storage off */
  }
}
