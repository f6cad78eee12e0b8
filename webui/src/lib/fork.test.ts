import { describe, expect, it } from 'vitest';
import { droppedAfter, keptForEdit, keptForRegenerate } from './fork';
import type { Message } from './types';

const u = (content: string): Message => ({ role: 'user', content, at: 0 });
const a = (content: string): Message => ({ role: 'assistant', content, at: 0 });
const chat = [u('q1'), a('a1'), u('q2'), a('a2'), u('q3'), a('a3')];

describe('forking a conversation', () => {
  it('an edit keeps the messages before the edited one', () => {
    expect(keptForEdit(chat, 2)).toBe(2);
    expect(chat.slice(0, keptForEdit(chat, 0)!)).toEqual([]);
    expect(keptForEdit(chat, 1)).toBeNull();
    expect(keptForEdit(chat, 9)).toBeNull();
  });

  it('a regenerate keeps everything up to the question it answers', () => {
    expect(chat.slice(0, keptForRegenerate(chat, 3)!).map((m) => m.content)).toEqual(['q1', 'a1', 'q2']);
    expect(keptForRegenerate(chat, 5)).toBe(5);
    expect(keptForRegenerate(chat, 2)).toBeNull();
    // Two answers in a row: both go.
    expect(keptForRegenerate([u('q'), a('cut'), a('again')], 2)).toBe(1);
    expect(keptForRegenerate([a('orphan')], 0)).toBeNull();
  });

  it('counts what a fork drops', () => {
    expect(droppedAfter(chat, 2)).toBe(3);
    expect(droppedAfter(chat, 5)).toBe(0);
  });
});
