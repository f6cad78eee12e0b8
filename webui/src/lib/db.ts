/** Chats persisted in the browser's IndexedDB (database `nebula-webui`, store `chats`, one record per chat). */
import { openDB, type DBSchema, type IDBPDatabase } from 'idb';
import { defaultSettings, type Chat } from './types';

interface Schema extends DBSchema {
  chats: { key: string; value: Chat; indexes: { updatedAt: number } };
}

const DB_NAME = 'nebula-webui';
let dbPromise: Promise<IDBPDatabase<Schema>> | null = null;

function db(): Promise<IDBPDatabase<Schema>> {
  dbPromise ??= openDB<Schema>(DB_NAME, 1, {
    upgrade(d) {
      const store = d.createObjectStore('chats', { keyPath: 'id' });
      store.createIndex('updatedAt', 'updatedAt');
    },
  });
  return dbPromise;
}

/** Every chat, most recently updated first. Records from older versions get today's default settings filled in. */
export async function listChats(): Promise<Chat[]> {
  const all = await (await db()).getAll('chats');
  return all
    .map((c) => ({ ...c, settings: { ...defaultSettings(), ...c.settings, sampling: { ...defaultSettings().sampling, ...c.settings?.sampling } } }))
    .sort((a, b) => b.updatedAt - a.updatedAt);
}

/** Stores a chat (a plain copy: Svelte's state proxies cannot be cloned into IndexedDB). */
export async function saveChat(chat: Chat): Promise<void> {
  const tx = (await db()).transaction('chats', 'readwrite');
  await Promise.all([tx.store.put(JSON.parse(JSON.stringify(chat)) as Chat), tx.done]);
}

export async function deleteChat(id: string): Promise<void> {
  // Resolves once the transaction has committed, so a reload right after cannot bring the chat back.
  const tx = (await db()).transaction('chats', 'readwrite');
  await Promise.all([tx.store.delete(id), tx.done]);
}

/** Forgets the open connection (tests, after deleting the database). */
export function resetConnection(): void {
  dbPromise = null;
}

export function newChatId(): string {
  return typeof crypto.randomUUID === 'function'
    ? crypto.randomUUID()
    : `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
}
