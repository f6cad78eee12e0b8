/**
 * Editing a sent message and regenerating an answer fork the conversation there: the messages after the fork point
 * are dropped and the model answers again from what is left. No alternative branches are kept (what was dropped is
 * gone, as the editor says before it is sent), so a chat is always one line of messages and the request holds
 * exactly what the page shows.
 */
import type { Message } from './types';

/** How many messages stay when the user message at `index` is replaced: those before it. `null`: not a user message. */
export function keptForEdit(messages: readonly Message[], index: number): number | null {
  return messages[index]?.role === 'user' ? index : null;
}

/**
 * How many messages stay when the answer at `index` is generated again: everything up to the user message it
 * answers. `null`: not an answer, or no user message before it.
 */
export function keptForRegenerate(messages: readonly Message[], index: number): number | null {
  if (messages[index]?.role !== 'assistant') return null;
  let kept = index;
  while (kept > 0 && messages[kept - 1].role === 'assistant') kept--;
  return kept > 0 ? kept : null;
}

/** How many messages after `index` a fork at `index` drops (the message itself is replaced, not counted). */
export function droppedAfter(messages: readonly Message[], index: number): number {
  return Math.max(0, messages.length - index - 1);
}
