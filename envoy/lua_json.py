"""The one JSON scanner the Envoy Lua filters share (Envoy's Lua has no JSON library).

`top_level_value(s, key)` finds top-level `key` of the JSON object `s` without parsing it:
strings and nested values are skipped, so the same key inside a message, a prompt or a
grammar doesn't count. lua.py reads TGI's `stream` with it, affinity.py OpenAI's
`prompt_cache_key`.

`object_keys(s, path)` lists the keys of the JSON object `s` and those of the objects
along `path` (e.g. {"parameters", "grammar"}: the keys of `s.parameters` and of
`s.parameters.grammar`), skipping strings and every other nested value the same way.
lua.py refuses the keys of a TGI body that the transcoder would drop with it.
"""

STRING_END = r"""
-- The index of the closing quote of the string that opens at `i` (escapes skipped); nil
-- if `s` is cut short. TOP_LEVEL_VALUE carries it; OBJECT_KEYS needs TOP_LEVEL_VALUE first.
local function string_end(s, i)
  local j = i + 1
  while true do
    j = s:find('["\\]', j)
    if j == nil then return nil end
    if s:sub(j, j) == '"' then return j end
    j = j + 2  -- skip the escaped character
  end
end
"""

TOP_LEVEL_VALUE = (
    STRING_END
    + r"""
-- The value of top-level `key` in the JSON object `s`: a string's raw text (escapes kept)
-- and true, or a literal (true, false, null, a number) and false; nil if absent or nested.
local function top_level_value(s, key)
  local i, depth, last, after_colon = 1, 0, nil, false
  while true do
    i = s:find('["{}%[%]:]', i)
    if i == nil then return nil end
    local c = s:sub(i, i)
    if c == '"' then
      local j = string_end(s, i)
      if j == nil then return nil end
      local text = s:sub(i + 1, j - 1)
      if after_colon then
        if depth == 1 and last == key then return text, true end
        last, after_colon = nil, false
      else
        last = text
      end
      i = j + 1
    elseif c == ':' then
      local literal = s:match('^%s*([%w%.%-%+]+)', i + 1)
      if literal ~= nil then
        if depth == 1 and last == key then return literal, false end
        -- the value was a literal: the next string is a key again
        last, after_colon = nil, false
      else
        after_colon = true
      end
      i = i + 1
    else
      if c == '{' or c == '[' then depth = depth + 1 else depth = depth - 1 end
      last, after_colon = nil, false
      i = i + 1
    end
  end
end
"""
)

# included after TOP_LEVEL_VALUE (lua.py), whose string_end it calls
OBJECT_KEYS = r"""
-- The keys of the JSON object `s` and of the objects along `path`, a list of key names:
-- keys[1] lists the keys of s, keys[2] those of s[path[1]] (every occurrence, if it is an
-- object), keys[3] those of s[path[1]][path[2]], ...; each key's raw text (escapes kept),
-- in order. Nothing else nested is looked into: strings, arrays, other objects. nil if s
-- is not an object or is cut short.
local function object_keys(s, path)
  local i = s:find('[^ \t\r\n]')
  if i == nil or s:sub(i, i) ~= '{' then return nil end
  local keys = {}
  for level = 1, #path + 1 do keys[level] = {} end
  -- on_path: how many of path's names lead to the open object at depth on_path + 1
  local depth, on_path, last, after_colon = 0, 0, nil, false
  while true do
    i = s:find('["{}%[%]:]', i)
    if i == nil then return nil end
    local c = s:sub(i, i)
    if c == '"' then
      local j = string_end(s, i)
      if j == nil then return nil end
      if after_colon then
        after_colon = false  -- a string value
      elseif depth == on_path + 1 then
        last = s:sub(i + 1, j - 1)
        table.insert(keys[depth], last)
      end
      i = j + 1
    elseif c == ':' then
      -- a literal value (true, false, null, a number): the next string is a key again
      after_colon = s:match('^%s*[%w%.%-%+]', i + 1) == nil
      i = i + 1
    elseif c == '{' or c == '[' then
      if c == '{' and after_colon and depth == on_path + 1 and last == path[depth] then
        on_path = depth  -- the object of the next name on the path
      end
      depth = depth + 1
      after_colon = false
      i = i + 1
    else
      if depth == on_path + 1 then on_path = depth - 2 end  -- leaving an object of path
      depth = depth - 1
      after_colon = false
      if depth == 0 then return keys end
      i = i + 1
    end
  end
end
"""
