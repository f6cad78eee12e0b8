/// <reference types="vitest/config" />
import { defineConfig, type Plugin } from 'vite';
import { svelte } from '@sveltejs/vite-plugin-svelte';

// The API the dev and preview servers proxy to (in the container, nginx does this; see nginx/).
const api = process.env.NEBULA_API_URL ?? 'http://127.0.0.1:8090';
const proxy = Object.fromEntries(['/v1', '/health', '/metrics'].map((p) => [p, { target: api, changeOrigin: true }]));

// Content-Security-Policy for the built page: only our own scripts run, whatever a model writes. Not in dev, where
// Vite injects inline scripts for hot reload. nginx sends the same policy as a header.
export const CSP =
  "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; " +
  "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'";

function cspMeta(): Plugin {
  return {
    name: 'nebula-csp-meta',
    apply: 'build',
    transformIndexHtml: () => [
      { tag: 'meta', attrs: { 'http-equiv': 'Content-Security-Policy', content: CSP }, injectTo: 'head-prepend' },
    ],
  };
}

export default defineConfig({
  plugins: [svelte(), cspMeta()],
  server: { proxy },
  preview: { proxy },
  build: { target: 'es2022', sourcemap: false, chunkSizeWarningLimit: 1500 },
  test: {
    include: ['src/**/*.test.ts'],
    environment: 'jsdom',
  },
});
