// JSON Patch (RFC 6902) over JSON Pointers (RFC 6901): add, remove, replace, move, copy,
// test. `applyPatch(doc, ops)` changes `doc` in place and returns the new document (a
// patch may replace the root). A failing op throws PatchError; the caller then asks for a
// fresh snapshot (the stream reconnects), so a half-applied patch is never kept.

export class PatchError extends Error {}

/** "/a~1b/c~0d" -> ["a/b", "c~d"] (RFC 6901 section 4: ~1 before ~0). */
export function parsePointer(pointer) {
  if (pointer === "") return [];
  if (!pointer.startsWith("/")) throw new PatchError(`bad JSON pointer ${pointer}`);
  return pointer
    .slice(1)
    .split("/")
    .map((token) => token.replaceAll("~1", "/").replaceAll("~0", "~"));
}

function arrayIndex(array, token, allowEnd) {
  if (token === "-" && allowEnd) return array.length;
  if (!/^(0|[1-9][0-9]*)$/.test(token)) throw new PatchError(`bad array index ${token}`);
  const index = Number(token);
  if (index > array.length || (!allowEnd && index === array.length)) {
    throw new PatchError(`array index ${token} out of range`);
  }
  return index;
}

function isContainer(value) {
  return value !== null && typeof value === "object";
}

/** The container holding the pointer's last token, and that token. */
function parentOf(doc, tokens) {
  let node = doc;
  for (const token of tokens.slice(0, -1)) {
    if (Array.isArray(node)) node = node[arrayIndex(node, token, false)];
    else if (isContainer(node) && Object.hasOwn(node, token)) node = node[token];
    else throw new PatchError(`path /${tokens.join("/")} does not exist`);
  }
  if (!isContainer(node)) throw new PatchError(`path /${tokens.join("/")} has no parent`);
  return [node, tokens[tokens.length - 1]];
}

function get(doc, tokens) {
  if (tokens.length === 0) return doc;
  const [parent, key] = parentOf(doc, tokens);
  if (Array.isArray(parent)) return parent[arrayIndex(parent, key, false)];
  if (!Object.hasOwn(parent, key)) throw new PatchError(`path /${tokens.join("/")} does not exist`);
  return parent[key];
}

function add(doc, tokens, value) {
  if (tokens.length === 0) return value;
  const [parent, key] = parentOf(doc, tokens);
  if (Array.isArray(parent)) parent.splice(arrayIndex(parent, key, true), 0, value);
  else parent[key] = value;
  return doc;
}

function remove(doc, tokens) {
  if (tokens.length === 0) throw new PatchError("cannot remove the whole document");
  const [parent, key] = parentOf(doc, tokens);
  if (Array.isArray(parent)) parent.splice(arrayIndex(parent, key, false), 1);
  else if (Object.hasOwn(parent, key)) delete parent[key];
  else throw new PatchError(`path /${tokens.join("/")} does not exist`);
  return doc;
}

function replaceAt(doc, tokens, value) {
  if (tokens.length === 0) return value;
  get(doc, tokens); // must exist
  const [parent, key] = parentOf(doc, tokens);
  if (Array.isArray(parent)) parent[arrayIndex(parent, key, false)] = value;
  else parent[key] = value;
  return doc;
}

/** Structural equality of JSON values (the `test` op; object key order does not matter). */
export function jsonEqual(a, b) {
  if (a === b) return true;
  if (Array.isArray(a)) {
    return Array.isArray(b) && a.length === b.length && a.every((x, i) => jsonEqual(x, b[i]));
  }
  if (isContainer(a) && isContainer(b) && !Array.isArray(b)) {
    const keys = Object.keys(a);
    return (
      keys.length === Object.keys(b).length &&
      keys.every((k) => Object.hasOwn(b, k) && jsonEqual(a[k], b[k]))
    );
  }
  return false;
}

const clone = (value) => (value === undefined ? value : structuredClone(value));

/** Applies `ops` in order to `doc` (changed in place) and returns the resulting document. */
export function applyPatch(doc, ops) {
  let result = doc;
  for (const op of ops) {
    const path = parsePointer(op.path);
    switch (op.op) {
      case "add":
        result = add(result, path, clone(op.value));
        break;
      case "remove":
        result = remove(result, path);
        break;
      case "replace":
        result = replaceAt(result, path, clone(op.value));
        break;
      case "move": {
        const from = parsePointer(op.from);
        if (path.length > from.length && from.every((t, i) => t === path[i])) {
          throw new PatchError(`cannot move ${op.from} into its own child ${op.path}`);
        }
        const value = get(result, from);
        result = add(remove(result, from), path, value);
        break;
      }
      case "copy":
        result = add(result, path, clone(get(result, parsePointer(op.from))));
        break;
      case "test":
        if (!jsonEqual(get(result, path), op.value)) {
          throw new PatchError(`test failed at ${op.path}`);
        }
        break;
      default:
        throw new PatchError(`unknown op ${op.op}`);
    }
  }
  return result;
}
