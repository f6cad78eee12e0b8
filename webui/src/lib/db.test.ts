import 'fake-indexeddb/auto';
import { describe, expect, it } from 'vitest';
import { deleteChat, listChats, newChatId, saveChat } from './db';
import { defaultSettings, type Chat } from './types';

const chat = (id: string, updatedAt: number): Chat => ({ id, title: id, createdAt: 0, updatedAt, messages: [{ role: 'user', content: id, at: 0 }], settings: defaultSettings() });

describe('IndexedDB chats', () => {
  it('stores, lists most recent first, updates and deletes', async () => {
    await saveChat(chat('a', 1));
    await saveChat(chat('b', 3));
    await saveChat(chat('c', 2));
    expect((await listChats()).map((c) => c.id)).toEqual(['b', 'c', 'a']);
    await saveChat({ ...chat('a', 9), title: 'renamed' });
    const all = await listChats();
    expect(all[0]).toMatchObject({ id: 'a', title: 'renamed' });
    await deleteChat('b');
    expect((await listChats()).map((c) => c.id)).toEqual(['a', 'c']);
  });

  it('fills settings missing from older records with defaults', async () => {
    const old = chat('old', 10) as unknown as Record<string, unknown>;
    old.settings = { thinking: false };
    await saveChat(old as unknown as Chat);
    const got = (await listChats()).find((c) => c.id === 'old')!;
    expect(got.settings).toEqual({ ...defaultSettings(), thinking: false });
  });

  it('makes unique ids', () => {
    expect(new Set(Array.from({ length: 100 }, newChatId)).size).toBe(100);
  });
});
